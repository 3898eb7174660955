"""Tiny PEFT adapters for builtin:tiny, written by the one adapter writer
(`inference_service.demo_adapters.write_peft_adapter`, which `make run` uses too)."""

from __future__ import annotations

from pathlib import Path

from inference_service.demo_adapters import ATTENTION, MLP, write_peft_adapter

ALL_MODULES = ATTENTION + MLP


def write_tiny_adapter(
    out: Path, seed: int, modules: tuple[str, ...] = ALL_MODULES, rank: int = 4, alpha: float | None = None
) -> Path:
    """Random A/B large enough to change greedy tokens; alpha defaults to 2 x rank."""
    return write_peft_adapter(out, rank=rank, alpha=2.0 * rank if alpha is None else alpha,
                              target_modules=modules, seed=seed, scale=0.3)
