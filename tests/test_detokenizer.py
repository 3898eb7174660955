"""Incremental detokenization: the streamed deltas add up to the text the model wrote, whatever
the tokenizer (byte-level with characters split across tokens, SentencePiece-style leading
spaces), seeded with the prompt's tail so the first generated token keeps its leading space,
and a split character is never streamed half.

The tokenizers are real ones built here with `tokenizers`: a Metaspace BPE (how Llama 2 and
Mistral write words: '▁word', the decoder drops the space of a decode's first piece) and a
GPT-2-style byte-level BPE (one character's bytes spread over several tokens).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from inference_service.tokenizer import ByteTokenizer, FileTokenizer, IncrementalDetokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Héllo wörld, ça va? Grüße aus Köln — naïve café.",
    "日本語のテキストと絵文字 🎉🚀 も混ざっています。",
    "def f(x):\n    return x * 2  # spaces   and\ttabs",
    "Numbers 12345 and symbols €£¥ © ® ™",
] * 4


def stream(tokenizer, token_ids: list[int], prompt: list[int] = ()) -> list[str]:  # type: ignore[no-untyped-def]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.update(token_ids[: i + 1], final=i == len(token_ids) - 1) for i in range(len(token_ids))]
    assert "".join(deltas) == detok.text
    return deltas


def _save(tok: Tokenizer, tmp_path) -> FileTokenizer:  # type: ignore[no-untyped-def]
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return FileTokenizer(path, eos_token_ids=())


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory) -> FileTokenizer:
    """SentencePiece-style: spaces become '▁' glued to the next word, the decoder turns them back
    and drops the first one; unknown characters fall back to <0xNN> byte pieces."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])  # Llama 2's tokenizer.json decoder
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>",
                                                                                        *bytes_]))
    return _save(tok, tmp_path_factory.mktemp("metaspace"))


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> FileTokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _save(tok, tmp_path_factory.mktemp("byte-level"))


TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd\x00"), max_size=30)


def _check(tokenizer: FileTokenizer, prompt_text: str, text: str) -> None:
    """Generated ids = how the tokenizer splits `text` after `prompt_text` (what a model would emit)."""
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    full = tokenizer.encode(prompt_text + text, add_special_tokens=False)
    if full[: len(prompt)] != prompt:
        return  # the boundary merges across prompt and text: not a prefix-free split
    generated = full[len(prompt) :]
    deltas = stream(tokenizer, generated, prompt)
    # the text the model wrote, in context: the full decode minus the prompt's decode
    expected = tokenizer.decode(prompt + generated)[len(tokenizer.decode(prompt)) :]
    assert "".join(deltas) == expected
    assert all("\ufffd" not in d for d in deltas[:-1]) or "\ufffd" in expected
    # without a prompt the stream is exactly the decode of the generated ids
    assert "".join(stream(tokenizer, generated)) == tokenizer.decode(generated)


@settings(max_examples=150, deadline=None)
@given(prompt=TEXT, text=TEXT)
def test_metaspace_stream_equals_the_decode(metaspace, prompt, text):
    _check(metaspace, prompt, text)


@settings(max_examples=150, deadline=None)
@given(prompt=TEXT, text=TEXT)
def test_byte_level_bpe_stream_equals_the_decode(byte_level, prompt, text):
    _check(byte_level, prompt, text)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_any_token_sequence_streams_its_decode(metaspace, byte_level, data):
    """Arbitrary ids (not only what encode makes), prompt-less: the stream is the decode."""
    for tok in (metaspace, byte_level):
        ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=25))
        assert "".join(stream(tok, ids)) == tok.decode(ids)


def test_a_prompt_ending_in_half_a_character_keeps_the_output_its_own_bytes():
    """A prompt ending in a lead byte (0xD3), then ids the byte tokenizer lacks (a larger model's
    vocabulary: they decode to nothing); the output's continuation byte (0x8C) must not complete
    the prompt's character: the output's text is its own decode, a lone byte as U+FFFD."""
    tokenizer = ByteTokenizer()
    prompt, generated = [104, 105, 0xD3, 2212, 1494], [300, 0x8C, 301, 0xC5]
    assert "".join(stream(tokenizer, generated, prompt)) == tokenizer.decode(generated) == "\ufffd\ufffd"


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_prompt_and_output_of_a_byte_level_tokenizer_stream_the_outputs_decode(byte_level, data):
    """Byte-level tokenizers strip no space: whatever the prompt (half a character at its end
    included), the stream is the decode of the output ids alone."""
    for tok, top in ((ByteTokenizer(), 400), (byte_level, byte_level.vocab_size - 1)):  # 258-400: ids it lacks
        prompt = data.draw(st.lists(st.integers(0, top), max_size=20))
        ids = data.draw(st.lists(st.integers(0, top), max_size=25))
        assert "".join(stream(tok, ids, prompt)) == tok.decode(ids)


def test_first_generated_token_keeps_its_leading_space(metaspace):
    """The SentencePiece bug this seeding fixes: 'Hello' + '▁world' must stream ' world'."""
    prompt = metaspace.encode("The quick brown", add_special_tokens=False)
    generated = metaspace.encode("The quick brown fox jumps", add_special_tokens=False)[len(prompt):]
    assert "".join(stream(metaspace, generated, prompt)) == " fox jumps"
    assert metaspace.decode(generated) == "fox jumps"  # what an unseeded decode would have streamed


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"), max_size=40))
def test_byte_tokenizer_streams_the_exact_text(text):
    tokenizer = ByteTokenizer()
    token_ids = list(text.encode("utf-8"))  # one byte per token: multi-byte characters span tokens
    deltas = stream(tokenizer, token_ids, tokenizer.encode("prompt é"))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas), "half a character was streamed"


def test_each_update_decodes_a_short_window():
    """A long generation costs linear, not quadratic, detokenization work."""

    class Counting(ByteTokenizer):
        decoded = 0

        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            Counting.decoded += len(token_ids)
            return super().decode(token_ids, skip_special_tokens)

    token_ids = list(("héllo wörld " * 100).encode("utf-8"))
    assert "".join(stream(Counting(), token_ids, list(range(50)))) == "héllo wörld " * 100
    assert Counting.decoded < 6 * len(token_ids)
