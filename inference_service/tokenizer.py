"""Tokenizers: Hugging Face `tokenizer.json` via `tokenizers`, or a byte-level one for builtin:tiny."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """Bytes 0-255 are tokens 0-255; BOS and EOS follow. Needs no files."""

    BOS = 256
    EOS = 257

    def __init__(self) -> None:
        self.vocab_size = 258
        self.eos_token_ids = (self.EOS,)

    def encode(self, text: str) -> list[int]:
        return [self.BOS, *text.encode("utf-8")]

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


class FileTokenizer:
    """A checkpoint's tokenizer.json (special tokens such as BOS added as the file says)."""

    def __init__(self, path: Path, eos_token_ids: tuple[int, ...]) -> None:
        self._tok = HFTokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_token_ids = eos_token_ids

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, holding back an incomplete UTF-8 tail."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = ""

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """All output tokens so far → the new text since the last call."""
        text = self.tokenizer.decode(token_ids)
        if not final and text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        if not text.startswith(self.text):
            return ""  # a held-back tail resolved differently: never retract sent text
        delta, self.text = text[len(self.text) :], text
        return delta
