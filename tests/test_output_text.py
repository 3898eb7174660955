"""An EngineCore with its defaults (detokenize=True, what an embedder gets) decodes text off its step:
no decode runs inside `step()` for a request without stop strings, and each output's text, decoded
when read (in any order), adds up to the decode of all its ids, for the hard cases (emoji, CJK,
code, byte tokens that split a character) with the byte tokenizer and with the real model's. Stop
strings still end a request at the token that completes them."""

from __future__ import annotations

import pickle

import pytest

from harness.engine_helpers import make_core, run_to_completion
from harness.real_model import require_real_model
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import FinishReason, Request, SamplingParams
from inference_service.structured import choice_spec

HARD = ["Emoji: 🎉👍🏽🇫🇷 and 👨\u200d👩\u200d👧", "CJK: 你好，世界！こんにちは、안녕하세요",
        "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1)  # 🐍\n"]


@pytest.fixture(scope="module", params=["builtin:tiny", pytest.param("real", marks=pytest.mark.slow)])
def core(request):
    if request.param == "real":
        core = EngineCore(EngineConfig(model=str(require_real_model()), device="cpu", max_loras=1, max_lora_rank=8,
                                       kv_cache_bytes=32 << 20))
    else:
        core = make_core(kv_cache_bytes=8 << 20)
    yield core
    core.shutdown()


def _count_step_decodes(core, monkeypatch) -> dict[str, int]:
    """Counts the tokenizer's decodes made inside `core.step()` and outside it."""
    counts, in_step = {"step": 0, "reader": 0}, [False]
    decode, step = core.tokenizer.decode, core.step

    def counted_decode(*args, **kwargs):
        counts["step" if in_step[0] else "reader"] += 1
        return decode(*args, **kwargs)

    def marked_step():
        in_step[0] = True
        try:
            return step()
        finally:
            in_step[0] = False

    monkeypatch.setattr(core.tokenizer, "decode", counted_decode)
    monkeypatch.setattr(core, "step", marked_step)
    return counts


def test_default_core_decodes_text_only_when_read(core, monkeypatch):
    tokenizer = core.tokenizer
    prompt = tokenizer.encode("Say something:")
    for i, text in enumerate(HARD):  # forced: the model must spell exactly this, token by token
        core.add_request(Request(f"hard{i}", prompt, SamplingParams(max_new_tokens=200, temperature=1.0, seed=i,
                                                                   grammar=choice_spec([text]))), None)
    for i in range(3):  # free sampling: with the byte tokenizer, often bytes that split a character
        core.add_request(Request(f"free{i}", prompt, SamplingParams(max_new_tokens=24, temperature=1.5, seed=i,
                                                                   ignore_eos=True)), None)
    counts = _count_step_decodes(core, monkeypatch)
    outputs = run_to_completion(core, timeout=600)
    assert counts == {"step": 0, "reader": 0}  # nothing decoded yet: nobody has read a text
    for rid, outs in outputs.items():
        ids = [t for o in outs for t in o.new_token_ids]
        if rid == "hard1":
            [o.text for o in reversed(outs)]  # out of order: the earlier outputs decode first anyway
        if rid == "free0":
            outs = pickle.loads(pickle.dumps(outs))  # decoded as they are pickled
        assert "".join(o.text for o in outs) == tokenizer.decode(ids), rid
        if rid.startswith("hard"):
            assert tokenizer.decode(ids) == HARD[int(rid[-1])] and outs[-1].finish_reason == FinishReason.EOS
    assert counts["step"] == 0 and counts["reader"] > 0
    assert core.runner.kv.num_used == 0


def test_stop_strings_still_stop_at_the_token_that_completes_them(core):
    tokenizer = core.tokenizer
    text, stop = HARD[1], "世界"
    core.add_request(Request("stop", tokenizer.encode("Say:"), SamplingParams(
        max_new_tokens=200, temperature=1.0, seed=1, grammar=choice_spec([text]), stop=(stop,))), None)
    outs = run_to_completion(core, timeout=600)["stop"]
    ids = [t for o in outs for t in o.new_token_ids]
    assert "".join(o.text for o in outs) == text[: text.index(stop)]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason == stop
    assert stop in tokenizer.decode(ids) and stop not in tokenizer.decode(ids[:-1])  # its last token completed it


def _byte_token(tokenizer, byte: int) -> int:
    return next(i for i in range(tokenizer.vocab_size) if tokenizer.token_bytes(i) == bytes((byte,)))


def test_a_prompt_ending_in_half_a_character_keeps_the_output_its_own_text(core):
    """The prompt ends in a lead byte (0xD3), the output is continuation bytes (0x8C, forced by a
    logit bias): the output must not complete the prompt's character; its text is its own decode."""
    tokenizer = core.tokenizer
    lead, continuation = _byte_token(tokenizer, 0xD3), _byte_token(tokenizer, 0x8C)
    core.add_request(Request("half", [*tokenizer.encode("Say:"), lead], SamplingParams(
        max_new_tokens=3, ignore_eos=True, logit_bias=((continuation, 100.0),))), None)
    outs = run_to_completion(core, timeout=600)["half"]
    ids = [t for o in outs for t in o.new_token_ids]
    assert ids == [continuation] * 3
    assert "".join(o.text for o in outs) == tokenizer.decode(ids) == "\ufffd" * 3
