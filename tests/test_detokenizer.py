"""Incremental detokenization: the streamed deltas add up to the full decode, whatever the
tokenizer (byte-level with characters split across tokens, word-level, SentencePiece-style
leading spaces), and a split character is never streamed half."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from inference_service.tokenizer import ByteTokenizer, FileTokenizer, IncrementalDetokenizer


def stream(tokenizer, token_ids: list[int]) -> list[str]:  # type: ignore[no-untyped-def]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.update(token_ids[: i + 1], final=i == len(token_ids) - 1) for i in range(len(token_ids))]
    assert "".join(deltas) == detok.text
    return deltas


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"), max_size=40))
def test_byte_level_streams_the_exact_text(text):
    tokenizer = ByteTokenizer()
    token_ids = list(text.encode("utf-8"))  # one byte per token: multi-byte characters span tokens
    deltas = stream(tokenizer, token_ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas), "half a character was streamed"


def _metaspace_tokenizer(tmp_path) -> FileTokenizer:  # type: ignore[no-untyped-def]
    """Words as '▁word' pieces; decoding drops the leading space of the first piece."""
    vocab = {"[UNK]": 0, **{f"\u2581w{i}": i + 1 for i in range(20)}, **{f"x{i}": i + 21 for i in range(5)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return FileTokenizer(path, eos_token_ids=())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 25), max_size=30))
def test_sentencepiece_style_spaces_survive_the_window(tmp_path_factory, token_ids):
    tokenizer = _metaspace_tokenizer(tmp_path_factory.mktemp("tok"))
    assert "".join(stream(tokenizer, token_ids)) == tokenizer.decode(token_ids)


def test_each_update_decodes_a_short_window():
    """A long generation costs linear, not quadratic, detokenization work."""

    class Counting(ByteTokenizer):
        decoded = 0

        def decode(self, token_ids: list[int]) -> str:
            Counting.decoded += len(token_ids)
            return super().decode(token_ids)

    token_ids = list(("héllo wörld " * 100).encode("utf-8"))
    assert "".join(stream(Counting(), token_ids)) == "héllo wörld " * 100
    assert Counting.decoded < 6 * len(token_ids)
