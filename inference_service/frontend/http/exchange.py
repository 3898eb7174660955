"""One completion or chat completion on the HTTP front end, from admission to its last byte: the
admitted Generation (admission.py) and the HTTP status its client got, closed and logged once."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from inference_service.engine.request import RequestOutput
from inference_service.engine.streams import RequestStream
from inference_service.frontend.admission import Generation

log = logging.getLogger("loraplex.http")


@dataclass
class Exchange:
    gen: Generation
    status: int = 200  # what the client was answered (499: it left before the end)

    @property
    def request_id(self) -> str:
        return self.gen.request_id

    @property
    def n(self) -> int:
        return self.gen.n

    @property
    def streams(self) -> list[RequestStream]:
        return self.gen.streams

    @property
    def prompt_tokens(self) -> int:
        return self.gen.prompt_tokens

    def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self.gen.outputs()

    def close(self) -> None:
        """Ends the generation (admission.Generation.close) and logs its outcome, the first time only."""
        gen = self.gen
        if gen.closed:
            return
        if gen.close() and self.status == 200:  # a sample was still running: the client left
            self.status = 499
        log.info("request %s adapter=%s finish=%s status=%d tokens=%d seconds=%.3f tenant=%s", gen.request_id,
                 gen.adapter or "-", gen.finish, self.status, gen.tokens, time.monotonic() - gen.started, gen.tenant)
