"""What the scheduler hands the model runner for one step (so the runner needs no scheduler)."""

from __future__ import annotations

from dataclasses import dataclass, field

from inference_service.engine.request import Request


@dataclass
class ScheduledBatch:
    items: list[tuple[Request, int]] = field(default_factory=list)  # request, tokens this step

    def __bool__(self) -> bool:
        return bool(self.items)
