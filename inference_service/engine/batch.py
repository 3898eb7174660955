"""What the scheduler hands the model runner for one step (so the runner needs no scheduler)."""

from __future__ import annotations

from dataclasses import dataclass, field

from inference_service.engine.request import Request


@dataclass
class ScheduledBatch:
    items: list[tuple[Request, int]] = field(default_factory=list)  # request, tokens this step
    # Set when the step is launched, per item: the block table it wrote and the position it reached
    # (its full blocks are cached once the step completed: `Scheduler.postprocess`).
    tables: list[list[int]] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.items)
