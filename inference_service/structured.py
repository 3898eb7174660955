"""Structured output: what a constraint is (`GrammarSpec`), its bounds, and how xgrammar compiles it.

Shared below both halves: the front ends build and check specs (frontend/grammar_check.py compiles
each new one in a child process, bounded in time and memory, before the request is submitted), the
engine core compiles it again off the scheduler step (engine/grammar.py, cached by `GrammarSpec.key`)
and masks the sampled row's logits with it (engine/model_runner.py). xgrammar is imported only
where a grammar is compiled or matched: it pulls in triton and tvm-ffi (seconds of import).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from adapter_cache.errors import InvalidArgumentError

if TYPE_CHECKING:
    import xgrammar

    from inference_service.tokenizer import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar's text (a request body's share; docs/http.md)
MAX_SCHEMA_DEPTH = 32  # nesting of a JSON schema's objects and arrays
MAX_CHOICES = 1024
# Strings the JSON grammar takes for a JSON object without a schema (`json_object`).
JSON_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True)
class GrammarSpec:
    """One request's constraint: `kind` (KINDS) and its text (a JSON schema, a regex, a JSON list of
    choices, an EBNF grammar). `strict`: a json_schema's OpenAI `strict` (no properties or items
    beyond the schema's). Hashable and small: it crosses the engine's pipe inside SamplingParams."""

    kind: str
    text: str
    strict: bool = False

    @property
    def key(self) -> str:
        """The content hash compiled grammars are cached by."""
        return hashlib.sha256(f"{self.kind}\0{int(self.strict)}\0{self.text}".encode()).hexdigest()

    def validate(self) -> None:
        """Bounds checked before anything compiles it (the compile's own bounds: grammar_check.py)."""
        if self.kind not in KINDS:
            raise InvalidArgumentError(f"unknown constraint kind {self.kind!r} (one of {', '.join(KINDS)})")
        if len(self.text) > MAX_SPEC_CHARS:
            raise InvalidArgumentError(f"{self.kind} is longer than {MAX_SPEC_CHARS} characters")
        if self.kind in ("json_schema", "choice"):
            try:
                value = json.loads(self.text)
            except ValueError as e:
                raise InvalidArgumentError(f"{self.kind} is not valid JSON: {e}") from None
            if self.kind == "json_schema":
                if not isinstance(value, dict | bool):
                    raise InvalidArgumentError("json_schema must be a JSON object")
                if (depth := _depth(value)) > MAX_SCHEMA_DEPTH:
                    raise InvalidArgumentError(f"json_schema nests {depth} levels deep, more than {MAX_SCHEMA_DEPTH}")
            elif not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
                raise InvalidArgumentError("choice must be a non-empty list of strings")
            elif len(value) > MAX_CHOICES:
                raise InvalidArgumentError(f"choice has more than {MAX_CHOICES} entries")
        elif not self.text and self.kind != "json_object":
            raise InvalidArgumentError(f"{self.kind} is empty")


def json_schema_spec(schema: Any, strict: bool = False) -> GrammarSpec:
    """A JSON schema given as a parsed value or as its text. Its keys keep their order: the grammar
    emits an object's properties in the schema's order (a reasoning-first schema reasons first), so
    two schemas that differ only in key order are two constraints with two cache keys."""
    text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
    return GrammarSpec("json_schema", text, strict)


def choice_spec(choices: Sequence[str]) -> GrammarSpec:
    return GrammarSpec("choice", json.dumps(list(choices), ensure_ascii=False))


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion (json.loads already bounds it)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


# ---- the vocabulary as xgrammar sees it ---------------------------------------------------------------------

def grammar_vocab(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """Each token id's bytes, for xgrammar's RAW vocabulary: b"" for special tokens and for the
    model's padding ids beyond the tokenizer (xgrammar never allows an empty token, except the
    stop tokens: EOS can end a grammar but no special token can appear inside one)."""
    special = set(special_token_ids(tokenizer)) | set(tokenizer.eos_token_ids)
    n = min(tokenizer.vocab_size, vocab_size)
    return [b"" if i in special else tokenizer.token_bytes(i) for i in range(n)] + [b""] * (vocab_size - n)


def special_token_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    ids = getattr(tokenizer, "special_token_ids", None)
    return tuple(ids) if ids is not None else ()


def tokenizer_info(vocab: list[bytes], stop_token_ids: Sequence[int]) -> xgrammar.TokenizerInfo:
    import xgrammar as xgr

    return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=len(vocab),
                             stop_token_ids=list(stop_token_ids))


def compile_spec(compiler: xgrammar.GrammarCompiler, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
    """The spec compiled. Raises ValueError (or xgrammar's errors, RuntimeError subclasses) for a
    spec that does not compile."""
    if spec.kind in ("json_schema", "json_object"):
        return compiler.compile_grammar(json_grammar(spec))
    if spec.kind == "regex":
        return compiler.compile_regex(spec.text)
    if spec.kind == "choice":
        alternatives = " | ".join(_ebnf_literal(c) for c in json.loads(spec.text))
        return compiler.compile_grammar(f"root ::= {alternatives}")
    if spec.kind == "grammar":
        return compiler.compile_grammar(spec.text)
    raise ValueError(f"unknown constraint kind {spec.kind!r}")


# xgrammar 0.2.9 writes a string with maxLength/minLength as characters `[^"\\\r\n]`, which lets
# other control characters (U+0000-U+001F) through unescaped: not JSON. Narrowed to JSON's own rule.
_LOOSE_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_CHARS = '[^\\0-\\x1f\\"\\\\]'
# Its negated classes also match the UTF-16 surrogates U+D800-U+DFFF, whose 3-byte forms are not UTF-8:
# a byte-level vocabulary then spells invalid text (decoded as U+FFFD, one per byte: past maxLength).
_NO_SURROGATES = "\\uD800-\\uDFFF"


def _without_surrogates(ebnf: str) -> str:
    """Every negated character class of an EBNF grammar (outside its string literals) also excludes
    the surrogates."""
    out, i, quoted, in_class = [], 0, False, False
    while i < len(ebnf):
        c = ebnf[i]
        if c == "\\":
            out.append(ebnf[i : i + 2])
            i += 2
            continue
        if quoted:
            quoted = c != '"'
        elif in_class:
            in_class = c != "]"
        elif c == '"':
            quoted = True
        elif c == "[":
            in_class = True
            if ebnf.startswith("[^", i):
                out.append("[^" + _NO_SURROGATES)
                i += 2
                continue
        out.append(c)
        i += 1
    return "".join(out)


def json_grammar(spec: GrammarSpec) -> str:
    """A json_schema or json_object spec as xgrammar EBNF. Compact JSON (no whitespace but a
    separator's): a model that may emit any whitespace can emit it forever (vLLM's
    `disable_any_whitespace`)."""
    import xgrammar as xgr

    schema = spec.text if spec.kind == "json_schema" else JSON_OBJECT_SCHEMA
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":"),
                                           strict_mode=spec.strict)
    return _without_surrogates(str(grammar).replace(_LOOSE_CHARS, _JSON_CHARS))


def _ebnf_literal(text: str) -> str:
    """An EBNF string literal matching `text` exactly (JSON's escapes are the grammar's)."""
    return json.dumps(text, ensure_ascii=False)
