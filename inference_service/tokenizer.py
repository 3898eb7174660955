"""Tokenizers: Hugging Face `tokenizer.json` via `tokenizers`, or a byte-level one for builtin:tiny."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes, which need not be whole UTF-8 characters (for logprobs)."""
        ...


class ByteTokenizer:
    """Bytes 0-255 are tokens 0-255; BOS and EOS follow. Needs no files."""

    BOS = 256
    EOS = 257

    def __init__(self) -> None:
        self.vocab_size = 258
        self.eos_token_ids = (self.EOS,)
        self.special_token_ids = (self.BOS, self.EOS)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.BOS, *text.encode("utf-8")] if add_special_tokens else list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            if max(token_ids, default=0) < 256:  # the common case, without a generator per call
                return bytes(token_ids).decode("utf-8", errors="replace")
            return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")
        return b"".join(map(self.token_bytes, token_ids)).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes((token_id,)) if token_id < 256 else {self.BOS: b"<s>", self.EOS: b"</s>"}.get(token_id, b"")


class FileTokenizer:
    """A checkpoint's tokenizer.json, or one built from a GGUF file's metadata (special tokens such
    as BOS added as the file says)."""

    def __init__(self, path: Path | HFTokenizer, eos_token_ids: tuple[int, ...]) -> None:
        self._tok = path if isinstance(path, HFTokenizer) else HFTokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_token_ids = eos_token_ids
        # Control tokens (BOS, EOS, chat markers): never part of a constrained output's text.
        self.special_token_ids = tuple(sorted(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        return hf_token_bytes(self._tok, token_id)


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode, which byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {chr(b if b in printable else next(extra)): b for b in range(256)}


_UNICODE_TO_BYTE = _unicode_to_byte()


def hf_token_bytes(tok: HFTokenizer, token_id: int) -> bytes:
    """A token's bytes: its decode when that is whole characters, else read from the vocabulary
    entry (a byte-level BPE piece, or a `<0xNN>` byte-fallback piece), where decode([id]) would
    give U+FFFD for every partial character alike."""
    text = tok.decode([token_id], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text.encode()
    piece = tok.id_to_token(token_id) or ""
    if match := _BYTE_FALLBACK.fullmatch(piece):
        return bytes((int(match.group(1), 16),))
    if piece and all(c in _UNICODE_TO_BYTE for c in piece):
        return bytes(_UNICODE_TO_BYTE[c] for c in piece)
    return text.encode()


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, holding back an incomplete UTF-8 tail.

    Seeded with the prompt's last tokens: the first generated token is decoded after them, as
    in the full text, so a tokenizer that drops the leading space of a decode's first piece
    (SentencePiece/Metaspace) keeps that token's space. Each update decodes a short window, not
    the whole output so far (that made a long generation quadratic): the tokens not yet
    emitted, after the previously emitted ones as context; both decodes start at the same
    token, so whatever a decoder does at a window's start it does to both and the difference
    is right.
    """

    PROMPT_CONTEXT = 6  # prompt tokens of context: enough for any decoder's look-back at a boundary
    MAX_PROMPT_CONTEXT = 96

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._context = self._prompt_context(prompt_token_ids)
        # Offsets count context + output tokens.
        self._prefix_offset = 0  # the window starts here: context, already emitted
        self._read_offset = len(self._context)  # tokens before this one are emitted

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt's last tokens, reaching back (a bounded way) past tokens that decode to
        nothing (skipped special tokens): a context that decodes empty is no context, the
        decoder would strip the first generated token's leading space again."""
        n = self.PROMPT_CONTEXT
        context = self._whole_characters(prompt_token_ids[-n:])
        while not self.tokenizer.decode(context, self.skip_special_tokens) and n < len(prompt_token_ids) \
                and n < self.MAX_PROMPT_CONTEXT:
            n *= 2
            context = self._whole_characters(prompt_token_ids[-n:])
        return context

    def _whole_characters(self, context: Sequence[int]) -> list[int]:
        """`context` without its tail of tokens that end in an incomplete character (a decode
        ending in U+FFFD): the output's first bytes would complete that character in the window's
        decode, which then no longer starts with the context's, and the output's own text (its
        lone bytes as U+FFFD, as a decode of the output alone gives them) would be lost."""
        context = list(context)
        while context and self.tokenizer.decode(context, self.skip_special_tokens).endswith("\ufffd"):
            context.pop()
        return context

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """All output tokens so far → the new text since the last call."""
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(self._window(token_ids, self._prefix_offset, self._read_offset), skip)
        text = self.tokenizer.decode(self._window(token_ids, self._prefix_offset, None), skip)
        if not final and text.endswith("\ufffd"):
            return ""  # a character split across tokens: wait for the rest of it
        delta = text[len(prefix) :] if text.startswith(prefix) else ""  # never retract sent text
        if delta:
            # Slide only past tokens that produced text: a window must not start at a token that
            # decodes to nothing (a skipped special token), where a decoder would strip the next
            # piece's leading space in `text` but not in `prefix`.
            self.text += delta
            self._prefix_offset, self._read_offset = self._read_offset, len(self._context) + len(token_ids)
        return delta

    def _window(self, token_ids: list[int], start: int, end: int | None) -> list[int]:
        """Tokens [start, end) of context + output, without joining the two whole."""
        n = len(self._context)
        out_end = None if end is None else max(0, end - n)
        head = self._context[start:end] if start < n else []
        return head + token_ids[max(0, start - n) : out_end]
