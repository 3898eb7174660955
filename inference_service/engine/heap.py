"""The garbage collector's view of a serving process."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Moves everything allocated so far (torch, the model, the tokenizer, grpc, the app) out of the
    collector's reach, as vLLM and SGLang do after start-up.

    Those objects live as long as the process, yet every full collection walks them all: measured
    with the benchmark's 256 streams, a gen-2 pass took 100-180 ms in the engine core process (10-18
    missed 10 ms steps) and in the front end (a stall of every stream). Frozen, a full pass walks only
    what serving allocated since. A cycle among the frozen objects is never collected: they are
    meant to live to the end anyway."""
    gc.collect()
    gc.freeze()
