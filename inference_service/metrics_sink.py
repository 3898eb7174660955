"""What the engine reports as it runs (counters, histograms), kept free of Prometheus imports.

Called from the scheduler thread; `inference_service.frontend.metrics` implements it for Prometheus.
"""

from __future__ import annotations

from typing import Protocol


class MetricsSink(Protocol):
    def adapter_loaded(self, tier: str, seconds: float) -> None: ...

    def adapter_evicted(self) -> None: ...

    def first_token(self, seconds: float) -> None: ...

    def inter_token(self, seconds: float) -> None: ...

    def tokens(self, prompt: int, generated: int) -> None: ...

    def request_finished(self, finish_reason: str, adapter: str | None) -> None: ...


class NullMetrics:
    """For tests and embedding without a metrics endpoint."""

    def adapter_loaded(self, tier: str, seconds: float) -> None:
        pass

    def adapter_evicted(self) -> None:
        pass

    def first_token(self, seconds: float) -> None:
        pass

    def inter_token(self, seconds: float) -> None:
        pass

    def tokens(self, prompt: int, generated: int) -> None:
        pass

    def request_finished(self, finish_reason: str, adapter: str | None) -> None:
        pass
