"""--seed (EngineConfig.seed) seeds sampling for requests that bring no seed of their own: the same
engine seed and the same arrivals sample the same tokens, another seed other tokens, and a
request's own seed wins over it. On builtin:tiny (CPU, deterministic random weights)."""

from __future__ import annotations

from harness.engine_helpers import generate
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import SamplingParams

UNSEEDED = SamplingParams(temperature=1.5, max_new_tokens=24, ignore_eos=True)
PROMPTS = {f"r{i}": ([256, 65 + i, 66, 67], None) for i in range(3)}


def _sample(seed: int, params: SamplingParams = UNSEEDED) -> dict[str, list[int]]:
    core = EngineCore(EngineConfig(kv_cache_bytes=2 << 20, device="cpu", seed=seed))
    try:
        return generate(core, PROMPTS, params)
    finally:
        core.shutdown()


def test_engine_seed_makes_unseeded_sampling_reproducible():
    first, again, other = _sample(1), _sample(1), _sample(2)
    assert first == again
    assert first != other
    assert len({tuple(tokens) for tokens in first.values()}) == len(PROMPTS)  # each request its own draws


def test_a_request_seed_wins_over_the_engine_seed():
    seeded = SamplingParams(temperature=1.5, max_new_tokens=24, ignore_eos=True, seed=7)
    assert _sample(1, seeded) == _sample(2, seeded)
