"""OpenAI/vLLM sampling parity: the math of repetition penalty, min_p, min_tokens and logit bias
equals transformers' logits processors on the same scores and history; frequency/presence
penalties equal OpenAI's documented formula; logprobs are the log-softmax of the processed
logits; and through EngineCore the sampled tokens follow the processed distribution, the
matched stop string is reported, and skip_special_tokens decides the text."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from adapter_cache.errors import InvalidArgumentError
from harness.engine_helpers import run_to_completion
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import FinishReason, Request, SamplingParams
from inference_service.engine.sampling import min_p_filter, process_logits, token_logprobs

V = 258
EOS = 257


def _request(prompt: list[int], output: list[int], **params) -> Request:
    r = Request("r", prompt, SamplingParams(max_new_tokens=64, **params))
    r.output_token_ids = list(output)
    return r


def _scores(seed: int) -> torch.Tensor:
    return torch.randn(1, V, generator=torch.Generator().manual_seed(seed)) * 4


HISTORIES = [([256, 1, 2, 3, 3], [4, 5, 4, 4]), ([256, 9], []), ([256, *range(40)], [7] * 10 + [200, 201])]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
@pytest.mark.parametrize("history", HISTORIES)
def test_repetition_penalty_matches_transformers(penalty, history):
    prompt, output = history
    scores = _scores(1)
    ours = process_logits(scores, [_request(prompt, output, repetition_penalty=penalty)], (EOS,))
    ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), scores.clone())
    torch.testing.assert_close(ours, ref)
    assert not torch.equal(ours, scores), "the penalty changed nothing"


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_min_p_matches_transformers(min_p, temperature):
    scores = _scores(2)
    warmed = TemperatureLogitsWarper(temperature)(None, scores.clone())
    ref = MinPLogitsWarper(min_p)(None, warmed.clone())
    ours = min_p_filter(warmed[0], min_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref[0]))
    torch.testing.assert_close(ours[~torch.isinf(ours)], ref[0][~torch.isinf(ref[0])])
    assert torch.isinf(ours).any()


@pytest.mark.parametrize("generated", [0, 2, 5])
def test_min_tokens_matches_transformers(generated):
    prompt, output = [256, 1, 2], [10] * generated
    scores = _scores(3)
    ours = process_logits(scores, [_request(prompt, output, min_tokens=5, stop_token_ids=(42,))], (EOS,))
    ref = MinNewTokensLengthLogitsProcessor(len(prompt), 5, [EOS, 42])(torch.tensor([prompt + output]),
                                                                        scores.clone())
    torch.testing.assert_close(ours, ref)


def test_logit_bias_matches_transformers_sequence_bias():
    scores = _scores(4)
    bias = ((65, 5.0), (66, -100.0), (3, 0.25))
    ours = process_logits(scores, [_request([256], [], logit_bias=bias)], (EOS,))
    ref = SequenceBiasLogitsProcessor({(t,): b for t, b in bias})(torch.tensor([[256]]), scores.clone())
    torch.testing.assert_close(ours, ref)


def test_frequency_and_presence_penalties_follow_openais_formula():
    """mu[j] -> mu[j] - c[j] * frequency_penalty - float(c[j] > 0) * presence_penalty, over the output."""
    scores = _scores(5)
    prompt, output = [256, 1, 1, 1], [4, 5, 4, 4, 9]
    ours = process_logits(scores, [_request(prompt, output, frequency_penalty=0.5, presence_penalty=1.5)], (EOS,))
    expected = scores.clone()
    for token in set(output):
        expected[0, token] -= output.count(token) * 0.5 + 1.5
    torch.testing.assert_close(ours, expected)
    assert ours[0, 1] == scores[0, 1], "prompt tokens are not penalised by frequency/presence"


def test_rows_that_ask_nothing_are_untouched_and_not_copied():
    scores = _scores(6).repeat(2, 1)
    same = process_logits(scores, [_request([1], [2]), _request([1], [2])], (EOS,))
    assert same is scores
    mixed = process_logits(scores, [_request([1], [2]), _request([1], [2], presence_penalty=1.0)], (EOS,))
    assert torch.equal(mixed[0], scores[0]) and not torch.equal(mixed[1], scores[1])
    assert torch.equal(scores[1], _scores(6)[0]), "the input was modified"


def test_token_logprobs_are_the_log_softmax():
    row = _scores(7)[0]
    lp = token_logprobs(row, 12, k=5)
    ref = row.log_softmax(-1)
    assert lp.token_id == 12 and lp.logprob == pytest.approx(float(ref[12]), abs=1e-6)
    top = torch.topk(ref, 5)
    assert [t for t, _ in lp.top] == top.indices.tolist()
    assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert token_logprobs(row, 12, k=0).top == ()


@pytest.mark.parametrize("bad", [
    dict(frequency_penalty=2.5), dict(presence_penalty=-3.0), dict(repetition_penalty=0.0),
    dict(repetition_penalty=float("nan")), dict(min_p=1.5), dict(min_tokens=65), dict(min_tokens=-1),
    dict(logprobs=21), dict(logprobs=-1), dict(logit_bias=((1, 101.0),)), dict(logit_bias=((-1, 1.0),)),
    dict(logit_bias=tuple((i, 1.0) for i in range(301))),
])
def test_bounds(bad):
    with pytest.raises(InvalidArgumentError):
        SamplingParams(max_new_tokens=64, **bad).validate(4096)


# ---- through the engine ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def core():
    core = EngineCore(EngineConfig(kv_cache_bytes=4 << 20, device="cpu"))
    yield core
    core.shutdown()


def _run(core, prompt, **params):
    params = SamplingParams(**{"max_new_tokens": 16, "ignore_eos": True, **params})
    core.validate(prompt, params)
    core.add_request(Request("x", prompt, params), None)
    return run_to_completion(core)["x"]


def test_engine_greedy_follows_the_processed_logits(core):
    """Each greedy token is the argmax of transformers' processors over the raw logits and history."""
    prompt = [256, *b"aaaa bbbb aaaa"]
    outs = _run(core, prompt, repetition_penalty=1.8, logit_bias=((97, 2.0),), min_tokens=3, return_logits=True,
                ignore_eos=False)
    tokens = [t for o in outs for t in o.new_token_ids]
    logits = [lg for o in outs for lg in (o.logits or [])]
    assert len(tokens) == len(logits) > 3
    for i, (token, raw) in enumerate(zip(tokens, logits, strict=True)):
        ids = torch.tensor([prompt + tokens[:i]])
        scores = RepetitionPenaltyLogitsProcessor(1.8)(ids, raw.float()[None].clone())
        scores = SequenceBiasLogitsProcessor({(97,): 2.0})(ids, scores)
        scores = MinNewTokensLengthLogitsProcessor(len(prompt), 3, [EOS])(ids, scores)
        assert token == int(scores.argmax()), i
    plain = [t for o in _run(core, prompt) for t in o.new_token_ids]
    assert plain != tokens, "the penalties changed nothing"


def test_engine_logprobs_and_min_tokens(core):
    outs = _run(core, [256, *b"Hello"], logprobs=3, max_new_tokens=8)
    lps = [lp for o in outs for lp in o.logprobs]
    tokens = [t for o in outs for t in o.new_token_ids]
    assert [lp.token_id for lp in lps] == tokens
    for lp in lps:  # greedy: the chosen token is the most likely one
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id and lp.logprob == pytest.approx(lp.top[0][1])
        assert lp.logprob <= 0


def test_engine_reports_the_matched_stop_string(core):
    prompt = [256, *b"The quick brown"]
    text = "".join(o.text for o in _run(core, prompt, max_new_tokens=24))
    stop = text[6:9]
    outs = _run(core, prompt, max_new_tokens=24, stop=("\x00never", stop))
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_reason == stop
    first = [t for o in _run(core, prompt) for t in o.new_token_ids][0]
    outs = _run(core, prompt, stop_token_ids=(first,))
    assert outs[-1].stop_reason == first


def test_engine_skip_special_tokens(core):
    prompt = [256, *b"Hi"]
    eos_banned = _run(core, prompt, max_new_tokens=4, logit_bias=((EOS, 100.0),))
    assert [t for o in eos_banned for t in o.new_token_ids] == [EOS] * 4
    assert "".join(o.text for o in eos_banned) == ""
    shown = _run(core, prompt, max_new_tokens=4, logit_bias=((EOS, 100.0),), skip_special_tokens=False)
    assert "".join(o.text for o in shown) == "</s>" * 4


def test_engine_min_tokens_holds_off_stop_strings_and_tokens(core):
    prompt = [256, *b"The quick brown"]
    tokens = [t for o in _run(core, prompt, max_new_tokens=24) for t in o.new_token_ids]
    text = "".join(o.text for o in _run(core, prompt, max_new_tokens=24))
    early = text[1:3]  # appears within the first few tokens
    assert _run(core, prompt, max_new_tokens=24, stop=(early,))[-1].finish_reason is FinishReason.STOP
    # ignore_eos: min_tokens bans no token here, so the same greedy tokens come, the early match included
    outs = _run(core, prompt, max_new_tokens=24, stop=(early,), min_tokens=20)
    generated = [t for o in outs for t in o.new_token_ids]
    assert len(generated) >= 20 and generated[:20] == tokens[:20], "stopped before min_tokens"
    outs = _run(core, prompt, max_new_tokens=24, min_tokens=5, stop_token_ids=(tokens[0],))
    assert len([t for o in outs for t in o.new_token_ids]) >= 5
