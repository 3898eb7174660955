"""The tokenizer a GGUF file describes, rebuilt as a `tokenizers.Tokenizer` from its metadata.

A GGUF has no tokenizer.json: it stores the vocabulary, merges, token types and special ids under
llama.cpp's keys (tokenizer.ggml.*). Byte-level BPE ("gpt2": Llama 3, Qwen2, SmolLM, ...) is built
as transformers' GGUF conversion builds it (GPT2Tokenizer's BPE, control tokens special,
user-defined tokens added), with the pre-tokenizer split that `tokenizer.ggml.pre` names
(llama.cpp's llama-vocab.cpp), so text splits the way the vocabulary's merges were learned.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from adapter_cache.errors import FailedPreconditionError

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Splits applied before GPT-2's byte-level regex (None: that regex alone), by tokenizer.ggml.pre.
_REGEX_SPLITS = {name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx")}
_REGEX_SPLITS.update({name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen")})
_DIGIT_SPLITS = {"smollm", "starcoder"}  # each digit on its own, then GPT-2's regex (SmolLM's tokenizer.json)


@cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table, which byte-level vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


def build_tokenizer(metadata: dict[str, Any], source: str) -> Tokenizer:
    """`metadata`: the file's tokenizer.* keys (values as Python objects)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok = _byte_level_bpe(metadata)
    elif kind == "llama":
        tok = _sentencepiece_bpe(metadata)
    else:
        raise FailedPreconditionError(
            f"{source}: GGUF tokenizer type {kind!r} is not supported (supported: 'gpt2', byte-level BPE; "
            "'llama', SentencePiece BPE); serve the model's Hugging Face checkpoint directory, which has a "
            "tokenizer.json")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    # Control tokens (<|im_start|>, <s>, ...) match whole and are skipped on decode; in a byte-level
    # vocabulary a control token not spelled in its alphabet is a llama.cpp mislabel, left alone as
    # transformers does. User-defined tokens match whole too, and are text.
    alphabet = set(_bytes_to_unicode().values()) if kind == "gpt2" else None
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, kind_ in zip(tokens, types, strict=False)
                            if kind_ == _CONTROL and (alphabet is None or set(t) <= alphabet)])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, kind_ in zip(tokens, types, strict=False) if kind_ == _USER_DEFINED])
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
    if metadata.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos_id is not None:
        bos = tokens[int(bos_id)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))])
    return tok


def _byte_level_bpe(metadata: dict[str, Any]) -> Tokenizer:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    alphabet = set(_bytes_to_unicode().values())
    spell = _bytes_to_unicode()
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = metadata.get("tokenizer.ggml.pre")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _REGEX_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in _DIGIT_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(metadata: dict[str, Any]) -> Tokenizer:
    """SentencePiece BPE (Llama 2, Mistral): ▁ for spaces, <0xNN> byte tokens for what the
    vocabulary lacks; as transformers' LlamaTokenizer builds it. Files without merges (most) get
    them recovered from the pieces' scores, as transformers' GGUF conversion does."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if metadata.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    else:
        merges = _merges_from_scores(vocab, metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1, right=0)] if prefix else []))
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary is a merge, ranked by the merged
    piece's score (transformers' generate_merges, with scores)."""
    found: list[tuple[str, str, float]] = []
    for piece, score in zip(vocab, scores, strict=False):
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        found += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]
