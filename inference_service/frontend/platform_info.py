"""The platform plan (inference_service/platform), as the engine reports it in `ModelInfo.platform`,
for the front ends: `GetModelInfo`'s rows and the `loraplex_platform_info` gauge."""

from __future__ import annotations

import re
from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from inference_service.api import inference_pb2 as pb
from inference_service.engine.types import ModelInfo


def platform_rows(info: ModelInfo) -> list[pb.PlatformRow]:
    return [pb.PlatformRow(key=key, value=value) for key, value in info.platform]


def label_name(key: str) -> str:
    """A plan row's key as a Prometheus label name ("attention decode" -> attention_decode)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


class PlatformInfoCollector(Collector):
    """`loraplex_platform_info{device=..., dtype=..., attention_decode=..., ...} 1`: one series whose
    labels are the plan's rows (constant for the process's life)."""

    def __init__(self, info: ModelInfo) -> None:
        self.labels = {label_name(key): value for key, value in info.platform}

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily("loraplex_platform_info", "The platform plan chosen at start-up: what computes "
                                   "what on this host, one label per choice.", labels=list(self.labels))
        family.add_metric(list(self.labels.values()), 1)
        yield family
