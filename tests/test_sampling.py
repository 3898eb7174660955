"""Sampling, stop handling and request validation through EngineCore on builtin:tiny, plus unit
tests of `inference_service.engine.sampling.sample` on crafted logits.

builtin:tiny has deterministic random weights and a byte tokenizer (0-255 bytes, 256 BOS, 257
EOS), so greedy runs are fixed and make good oracles for stop tokens and stop strings; its
random bytes are often invalid or multi-byte UTF-8, which exercises the incremental detokenizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

from adapter_cache.errors import InvalidArgumentError
from harness.engine_helpers import run_to_completion
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.kv_cache import kv_bytes_per_block
from inference_service.engine.request import FinishReason, Request, SamplingParams
from inference_service.engine.sampling import sample
from inference_service.models.loader import builtin_tiny_config

PROMPTS = {
    "hello": [256, *b"Hello world"],
    "fox": [256, *b"The quick brown"],
    "short": [256, 65],
    "long": [256, *b"In the beginning was the word, and the word was with the model."],
}


@dataclass
class Result:
    tokens: list[int]
    text: str
    deltas: list[str]
    finish_reason: FinishReason | None


@pytest.fixture(scope="module")
def core() -> EngineCore:
    core = EngineCore(EngineConfig(kv_cache_bytes=4 << 20, device="cpu", max_new_tokens_limit=512))
    yield core
    core.shutdown()


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Result]:
    """All requests in one engine run (batched together); per request: tokens, text, finish."""
    for rid, (prompt, params) in requests.items():
        core.validate(prompt, params)
        core.add_request(Request(rid, prompt, params), None)
    outputs = run_to_completion(core)
    assert core.runner.kv.num_used == 0
    results = {}
    for rid, outs in outputs.items():
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        assert outs[-1].error is None
        deltas = [o.text for o in outs]
        results[rid] = Result([t for o in outs for t in o.new_token_ids], "".join(deltas), deltas,
                              outs[-1].finish_reason)
    assert set(results) == set(requests)
    return results


def run_one(core: EngineCore, prompt: list[int], params: SamplingParams) -> Result:
    return run(core, {"one": (prompt, params)})["one"]


GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy(core) -> dict[str, Result]:
    return run(core, {name: (prompt, GREEDY) for name, prompt in PROMPTS.items()})


# ---- determinism and seeds ---------------------------------------------------------------------


def test_greedy_is_deterministic_alone_and_batched(core, greedy):
    for name, prompt in PROMPTS.items():
        alone = run_one(core, prompt, GREEDY)
        assert alone.tokens == greedy[name].tokens
        assert alone.finish_reason is FinishReason.LENGTH and len(alone.tokens) == GREEDY.max_new_tokens


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(core):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_new_tokens=24, ignore_eos=True)
    prompt = PROMPTS["fox"]
    first = run_one(core, prompt, params).tokens
    assert run_one(core, prompt, params).tokens == first
    # The same request among others (different prompts, seeds, unseeded and greedy neighbours).
    batch = run(core, {
        "noise-greedy": (PROMPTS["hello"], GREEDY),
        "target": (prompt, params),
        "noise-seeded": (PROMPTS["long"], replace(params, seed=99)),
        "noise-unseeded": (PROMPTS["short"], replace(params, seed=None, max_new_tokens=7)),
        "twin": (prompt, params),
    })
    assert batch["target"].tokens == first
    assert batch["twin"].tokens == first


def test_different_seeds_differ(core, greedy):
    params = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
    runs = run(core, {f"s{seed}": (PROMPTS["hello"], replace(params, seed=seed)) for seed in range(4)})
    sequences = {tuple(r.tokens) for r in runs.values()}
    assert len(sequences) == 4
    assert tuple(greedy["hello"].tokens[:16]) not in sequences


def test_top_k_1_and_tiny_top_p_equal_greedy(core, greedy):
    hot = SamplingParams(temperature=1.5, seed=7, max_new_tokens=24, ignore_eos=True)
    results = run(core, {
        **{f"k1-{n}": (p, replace(hot, top_k=1)) for n, p in PROMPTS.items()},
        **{f"p-{n}": (p, replace(hot, top_p=1e-6)) for n, p in PROMPTS.items()},
    })
    for name in PROMPTS:
        assert results[f"k1-{name}"].tokens == greedy[name].tokens
        assert results[f"p-{name}"].tokens == greedy[name].tokens


def test_engine_top_k_restricts_support(core):
    """With top_k=2 every sampled token is one of the two most likely at its step."""
    params = SamplingParams(temperature=5.0, top_k=2, seed=3, max_new_tokens=20, ignore_eos=True,
                            return_logits=True)
    core.add_request(Request("topk", PROMPTS["long"], params), None)
    outs = run_to_completion(core)["topk"]
    for out in outs:
        for token, logits in zip(out.new_token_ids, out.logits or [], strict=True):
            assert token in torch.topk(logits, 2).indices.tolist()


# ---- sample() on crafted logits ---------------------------------------------------------------


def draw(logits: list[float], params: SamplingParams, n: int = 2000, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    row = torch.tensor([logits])
    return torch.tensor([sample(row, [params], [gen])[0] for _ in range(n)])


PROBS = [0.4, 0.3, 0.2, 0.1]
LOGITS = [math.log(p) for p in PROBS]


def test_sample_greedy_picks_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 4.9]])
    assert sample(logits, [SamplingParams()] * 2, [None, None]) == [1, 0]


def test_sample_temperature_one_follows_the_distribution():
    counts = torch.bincount(draw(LOGITS, SamplingParams(temperature=1.0)), minlength=4) / 2000
    assert torch.allclose(counts, torch.tensor(PROBS), atol=0.04), counts


def test_sample_low_temperature_is_nearly_greedy():
    assert set(draw([1.0, 1.2, 0.8], SamplingParams(temperature=0.01), n=200).tolist()) == {1}


@pytest.mark.parametrize("top_k, support", [(1, {0}), (2, {0, 1}), (3, {0, 1, 2}), (4, {0, 1, 2, 3}),
                                             (100, {0, 1, 2, 3})])
def test_sample_top_k_support(top_k, support):
    tokens = draw(LOGITS, SamplingParams(temperature=1.0, top_k=top_k))
    assert set(tokens.tolist()) == support
    # Renormalised over the kept tokens.
    kept = torch.tensor(PROBS[: len(support)])
    counts = torch.bincount(tokens, minlength=4)[: len(support)] / len(tokens)
    assert torch.allclose(counts, kept / kept.sum(), atol=0.04), counts


@pytest.mark.parametrize("top_p, support", [(1e-6, {0}), (0.35, {0}), (0.45, {0, 1}), (0.65, {0, 1}),
                                             (0.75, {0, 1, 2}), (0.95, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})])
def test_sample_top_p_support(top_p, support):
    # Shuffled order: the nucleus is by probability, not by index.
    order = [2, 0, 3, 1]
    logits = [LOGITS[i] for i in order]
    tokens = draw(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert {order[t] for t in tokens.tolist()} == support


def test_sample_top_k_and_top_p_combine():
    # top_k=3 keeps 0.4/0.3/0.2 (renormalised 0.44/0.33/0.22); top_p=0.7 then keeps the first two.
    tokens = draw(LOGITS, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    assert set(tokens.tolist()) == {0, 1}


def test_sample_rows_are_independent_and_seeded():
    rows = torch.tensor([LOGITS, [0.0, 0.0, 9.0, 0.0], LOGITS])
    params = [SamplingParams(temperature=1.0, seed=5), SamplingParams(), SamplingParams(temperature=1.0, seed=5)]

    def draws(seed_a: int, seed_b: int) -> list[list[int]]:
        gens = [torch.Generator().manual_seed(seed_a), None, torch.Generator().manual_seed(seed_b)]
        return [sample(rows, params, gens) for _ in range(50)]

    same = draws(5, 5)
    assert all(r[1] == 2 for r in same)  # the greedy row
    assert [r[0] for r in same] == [r[2] for r in same]  # equal seeds, equal draws, in one batch
    assert same == draws(5, 5)
    other = draws(5, 6)
    assert [r[0] for r in other] == [r[0] for r in same]  # a neighbour's seed changes nothing
    assert [r[2] for r in other] != [r[2] for r in same]


# ---- stop tokens, EOS, length ------------------------------------------------------------------


def test_stop_token_ids_finish_with_stop_and_include_the_token(core, greedy):
    expected = greedy["fox"].tokens
    stop = expected[5]
    cut = expected.index(stop)
    result = run_one(core, PROMPTS["fox"], replace(GREEDY, stop_token_ids=(9999 % 256, stop)))
    assert result.finish_reason is FinishReason.STOP
    assert result.tokens == expected[: cut + 1]


def test_eos_finishes_with_eos_unless_ignored(core, greedy, monkeypatch):
    expected = greedy["hello"].tokens
    eos = expected[6]
    cut = expected.index(eos)
    monkeypatch.setattr(core.tokenizer, "eos_token_ids", (eos,))
    result = run_one(core, PROMPTS["hello"], replace(GREEDY, ignore_eos=False))
    assert result.finish_reason is FinishReason.EOS
    assert result.tokens == expected[: cut + 1]
    ignored = run_one(core, PROMPTS["hello"], GREEDY)
    assert ignored.finish_reason is FinishReason.LENGTH
    assert ignored.tokens == expected


@pytest.mark.parametrize("n", [1, 2, 17])
def test_max_new_tokens_gives_length_with_exactly_that_many(core, n):
    result = run_one(core, PROMPTS["long"], replace(GREEDY, max_new_tokens=n))
    assert result.finish_reason is FinishReason.LENGTH
    assert len(result.tokens) == n


def test_stop_token_wins_over_length_on_the_last_token(core, greedy):
    expected = greedy["long"].tokens
    n = next(n for n in range(10, len(expected) + 1) if expected[n - 1] not in expected[: n - 1])
    last = expected[n - 1]
    result = run_one(core, PROMPTS["long"], replace(GREEDY, max_new_tokens=n, stop_token_ids=(last,)))
    assert result.finish_reason is FinishReason.STOP and result.tokens == expected[:n]


# ---- stop strings and text ---------------------------------------------------------------------


def clean_spans(text: str, length: int) -> list[int]:
    """Start indices of substrings of `length` free of U+FFFD whose first occurrence is there."""
    return [
        i for i in range(len(text) - length + 1)
        if "\ufffd" not in text[i : i + length] and text.find(text[i : i + length]) == i
    ]


def greedy_text(core: EngineCore, greedy: dict[str, Result], name: str) -> str:
    text = core.tokenizer.decode(greedy[name].tokens)
    assert greedy[name].text == text
    return text


@pytest.mark.parametrize("name, length", [(name, 1) for name in PROMPTS] + [("hello", 3), ("fox", 3), ("long", 3)])
def test_stop_string_finishes_with_stop_and_excludes_it(core, greedy, name, length):
    text = greedy_text(core, greedy, name)
    starts = clean_spans(text, length)
    assert starts, f"no clean {length}-char span in {text!r}"
    start = starts[len(starts) // 2]
    stop = text[start : start + length]
    result = run_one(core, PROMPTS[name], replace(GREEDY, stop=("never-produced", stop)))
    assert result.finish_reason is FinishReason.STOP
    assert result.text == text[:start]
    assert stop not in result.text
    # Generation stopped at the token completing the stop string: a prefix of the greedy run.
    tokens = result.tokens
    assert tokens == greedy[name].tokens[: len(tokens)]
    assert stop in core.tokenizer.decode(tokens) and stop not in core.tokenizer.decode(tokens[:-1])


def test_earliest_of_several_stop_strings_wins(core, greedy):
    text = greedy_text(core, greedy, "fox")
    starts = clean_spans(text, 2)
    assert len(starts) >= 2, text
    early, late = starts[0], starts[-1]
    result = run_one(core, PROMPTS["fox"], replace(GREEDY, stop=(text[late : late + 2], text[early : early + 2])))
    assert result.finish_reason is FinishReason.STOP and result.text == text[:early]


def test_stop_string_completed_by_the_last_allowed_token(core, greedy):
    """A stop string that ends on the max_new_tokens-th token is still cut from the text."""
    name = "long"
    tokens = greedy[name].tokens
    for n in range(2, len(tokens) + 1):
        text = core.tokenizer.decode(tokens[:n])
        prev = core.tokenizer.decode(tokens[: n - 1])
        tail = text[len(prev) :] if text.startswith(prev) else ""
        if tail and "\ufffd" not in tail and text.find(tail) == len(prev):
            break
    else:
        raise AssertionError(f"no clean final character in {tokens}")
    result = run_one(core, PROMPTS[name], replace(GREEDY, max_new_tokens=n, stop=(tail,)))
    assert result.tokens == tokens[:n]
    assert result.text == prev
    assert result.finish_reason is FinishReason.STOP


def test_text_deltas_concatenate_to_the_decoded_tokens(core, greedy):
    for name, result in greedy.items():
        assert result.text == core.tokenizer.decode(result.tokens), name
    seeded = run(core, {f"s{i}": (p, SamplingParams(temperature=1.2, seed=i, max_new_tokens=40))
                        for i, p in enumerate(PROMPTS.values())})
    for result in seeded.values():
        assert result.text == core.tokenizer.decode(result.tokens)


def test_multibyte_utf8_is_streamed_whole(core, monkeypatch):
    """Force a greedy run onto the bytes of 'héllo €😀' and check every delta is valid text."""
    target = "héllo €😀!".encode()
    forced = iter(target)

    def forced_sample(logits, params, generators, c_argmax=True):
        return [next(forced) for _ in params]

    monkeypatch.setattr("inference_service.engine.model_runner.sample", forced_sample)
    result = run_one(core, PROMPTS["short"], replace(GREEDY, max_new_tokens=len(target)))
    assert result.tokens == list(target)
    assert result.text == "héllo €😀!"
    assert all("\ufffd" not in d for d in result.deltas), result.deltas
    # The 4-byte emoji arrives in one delta, after three empty ones.
    assert "😀" in result.deltas and result.deltas.count("") >= 1 + 2 + 3


def test_stop_string_with_multibyte_characters(core, monkeypatch):
    target = "naïve café—done".encode()
    forced = iter(target)
    monkeypatch.setattr("inference_service.engine.model_runner.sample", lambda *args: [next(forced)])
    result = run_one(core, PROMPTS["short"], replace(GREEDY, max_new_tokens=len(target), stop=("é—",)))
    assert result.finish_reason is FinishReason.STOP
    assert result.text == "naïve caf"
    assert result.tokens == list("naïve café—".encode())


def test_long_stop_string_starting_early_is_never_streamed(core, monkeypatch):
    target = b"abcdefghijklmnop"
    forced = iter(target)
    monkeypatch.setattr("inference_service.engine.model_runner.sample", lambda *args: [next(forced)])
    result = run_one(core, PROMPTS["short"], replace(GREEDY, max_new_tokens=len(target), stop=("cdefghij",)))
    assert result.finish_reason is FinishReason.STOP and result.text == "ab"
    assert result.tokens == list(b"abcdefghij")


def test_stop_strings_that_never_complete_leave_the_text_whole(core, greedy):
    text = greedy_text(core, greedy, "long")
    # A stop string whose start does occur: its first characters are held back, then released.
    stop = text[-2:] + "\x00never"
    result = run_one(core, PROMPTS["long"], replace(GREEDY, stop=(stop, "also never produced")))
    assert result.finish_reason is FinishReason.LENGTH
    assert result.tokens == greedy["long"].tokens and result.text == text


# ---- validation --------------------------------------------------------------------------------


OK_PROMPT = [256, 1, 2, 3]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=-0.1),
    SamplingParams(temperature=math.nan),
    SamplingParams(temperature=math.inf),
    SamplingParams(top_p=0.0),
    SamplingParams(top_p=-0.5),
    SamplingParams(top_p=1.0001),
    SamplingParams(top_p=math.nan),
    SamplingParams(top_k=-1),
    SamplingParams(max_new_tokens=0),
    SamplingParams(max_new_tokens=-3),
    SamplingParams(max_new_tokens=513),
    SamplingParams(stop=("",)),
    SamplingParams(stop_token_ids=(-1,)),
], ids=lambda p: ",".join(f"{k}={v}" for k, v in vars(p).items() if v != getattr(SamplingParams(), k)))
def test_invalid_sampling_params(core, params):
    with pytest.raises(InvalidArgumentError) as info:
        core.validate(OK_PROMPT, params)
    assert info.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize("prompt", [[], [258], [256, 1, 300], [-1, 5], [256, 10**9]],
                         ids=["empty", "vocab-size", "beyond-vocab", "negative", "huge"])
def test_invalid_prompt_tokens(core, prompt):
    with pytest.raises(InvalidArgumentError) as info:
        core.validate(prompt, SamplingParams())
    assert type(info.value) is InvalidArgumentError and info.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize("prompt_len, max_new", [(1024, 1), (2000, 1), (1000, 25), (1023, 2)])
def test_prompt_too_long_for_the_context(core, prompt_len, max_new):
    """Never fits, however idle the server: INVALID_ARGUMENT (HTTP 400), not a retryable RESOURCE_EXHAUSTED."""
    with pytest.raises(InvalidArgumentError, match="context of 1024 tokens") as info:
        core.validate([65] * prompt_len, SamplingParams(max_new_tokens=max_new))
    assert info.value.code == "INVALID_ARGUMENT"


def test_longest_fitting_request_is_accepted_and_served(core):
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    prompt = [65] * 1022
    core.validate(prompt, params)
    result = run_one(core, prompt, params)
    assert result.finish_reason is FinishReason.LENGTH and len(result.tokens) == 2


def test_request_larger_than_the_kv_cache():
    per_block = kv_bytes_per_block(builtin_tiny_config(), 16, torch.float32)
    small = EngineCore(EngineConfig(kv_cache_bytes=4 * per_block, block_size=16, device="cpu"))
    try:
        # The context advertised is what the KV cache holds, and past it the error names that limit.
        assert small.model_info.max_context == 64
        small.validate([65] * 60, SamplingParams(max_new_tokens=4))
        with pytest.raises(InvalidArgumentError, match="context of 64 tokens"):
            small.validate([65] * 60, SamplingParams(max_new_tokens=5))
    finally:
        small.shutdown()


def test_valid_edge_params_accepted(core):
    for params in [SamplingParams(top_p=1.0), SamplingParams(top_p=1e-9), SamplingParams(temperature=0.0),
                   SamplingParams(top_k=0), SamplingParams(max_new_tokens=512), SamplingParams(temperature=100.0)]:
        core.validate(OK_PROMPT, params)
