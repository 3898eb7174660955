"""Per-request fault containment in the engine and the staging pool's deadline and
per-source share, in process.

The faults injected here are bugs (a forward pass or a detokenizer that raises) and a source that
never returns: none can be caused for real through the API, so each is a patch, said where it is
made. The real-input cases (non-finite logits from an overflowing adapter, a hung origin) are in
tests/test_isolation_engine.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from adapter_cache.errors import UnavailableError
from harness.engine_helpers import run_to_completion
from harness.waiting import HANG_S
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import FinishReason, Request, SamplingParams
from inference_service.engine.sampling import NON_FINITE, sample
from inference_service.lora.staging_pool import StagingPool

PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)
PROMPTS = {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9]}


@pytest.fixture(scope="module")
def core() -> EngineCore:
    return EngineCore(EngineConfig(model="builtin:tiny", device="cpu"))


@pytest.fixture(scope="module")
def reference(core) -> dict[str, list[int]]:
    return {rid: tokens for rid, (tokens, _, _) in _run(core).items()}


def _run(core: EngineCore) -> dict[str, tuple[list[int], FinishReason | None, object]]:
    for rid, prompt in PROMPTS.items():
        core.add_request(Request(rid, prompt, PARAMS), None)
    results = {}
    for rid, outs in run_to_completion(core).items():
        last = outs[-1]
        results[rid] = ([t for o in outs for t in o.new_token_ids], last.finish_reason, last.error)
    assert core.runner.kv.num_used == 0 and not core.has_work()
    return results


def test_a_forward_pass_failing_for_one_request_ends_only_that_one(core, reference, monkeypatch):
    real_run = core.runner.run
    calls = {"n": 0}

    def run(batch):  # patch: a bug in the forward pass that only request "b"'s rows trigger
        calls["n"] += 1
        if any(r.request_id == "b" for r, _ in batch.items) and calls["n"] > 3:
            raise RuntimeError("simulated kernel failure")
        return real_run(batch)

    monkeypatch.setattr(core.runner, "run", run)
    results = _run(core)
    assert results["b"][1] is FinishReason.ERROR and results["b"][2].code == "INTERNAL"
    for rid in ("a", "c"):
        assert results[rid][:2] == (reference[rid], FinishReason.LENGTH)


def test_a_detokenizer_error_ends_only_that_request(core, reference, monkeypatch):
    real_on_token = core.outputs.on_token

    def on_token(request, logits, now):  # patch: a detokenizer bug hit by request "a" only (its 6th token)
        if request.request_id == "a" and len(request.output_token_ids) == 6:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated")
        return real_on_token(request, logits, now)

    monkeypatch.setattr(core.outputs, "on_token", on_token)
    results = _run(core)
    assert results["a"][1] is FinishReason.ERROR and results["a"][2].code == "INTERNAL"
    for rid in ("b", "c"):
        assert results[rid][:2] == (reference[rid], FinishReason.LENGTH)


def test_sampling_marks_only_non_finite_rows_and_tiny_temperatures_are_greedy():
    logits = torch.tensor([[0.0, 3.0, 1.0], [float("nan"), 1.0, 0.0], [0.0, float("inf"), 1.0], [2.0, 0.5, 1.0]])
    params = [SamplingParams(temperature=1e-300), SamplingParams(), SamplingParams(temperature=0.7),
              SamplingParams(temperature=1e-6, top_p=0.5)]
    assert sample(logits, params, [None] * 4) == [1, NON_FINITE, NON_FINITE, 0]
    # top_p below float32's resolution keeps the most likely token (it used to drop every one).
    assert sample(logits[:1], [SamplingParams(temperature=1.0, top_p=1e-300)], [None]) == [1]


def test_staging_pool_abandons_hung_tasks_and_a_stuck_source_does_not_block_another():
    """The clock is injected (`expire(now)`): no verdict waits on the host's speed. A deadline far
    away (60 s) is never reached by itself during the test."""
    release = threading.Event()
    pool = StagingPool(workers=2, timeout_s=60.0)
    hung = [pool.submit(release.wait, key="http://stuck") for _ in range(3)]
    other = pool.submit(lambda: "ok", key="s3://fine")
    # The stuck source holds both workers (and its third task queues), yet this one runs: nothing
    # was abandoned yet, as expire() has not been called.
    assert other.result(timeout=HANG_S) == "ok"
    assert not any(f.done() for f in hung)
    pool.expire(now=time.monotonic())  # before the deadline: nothing abandoned
    assert not any(f.done() for f in hung)
    pool.expire(now=time.monotonic() + pool.timeout_s)  # past the running two's deadline
    done = [f for f in hung if f.done()]
    assert len(done) == 2 and all(isinstance(f.exception(), UnavailableError) for f in done)
    # The queued third started when the two were abandoned; it is abandoned at its own deadline.
    pool.expire(now=time.monotonic() + 2 * pool.timeout_s)
    assert isinstance(hung[2].exception(timeout=0), UnavailableError)
    release.set()
    assert pool.submit(lambda: 7).result(timeout=HANG_S) == 7
    pool.shutdown()
