"""JSON from untrusted adapter files, with bounds: UTF-8 only, no NaN/Infinity tokens, no duplicate
keys, integers of at most 20 digits, nesting at most MAX_DEPTH deep.

Python's json would otherwise accept a 100,000-deep nest (RecursionError, a traceback), a 5000-digit
integer (ValueError from int()), `NaN`, and the last of two equal keys (a parser differential:
another reader may take the first). Every failure here is one AdapterError naming the file.
"""

from __future__ import annotations

import json
import math

from inference_service.errors import AdapterError

MAX_DEPTH = 32
MAX_INT_DIGITS = 20


class _Refused(ValueError):
    pass


def _parse_int(text: str) -> int:
    if len(text) - text.startswith("-") > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > 64:
        raise _Refused(f"a number written with {len(text)} characters (at most 64)")
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"a number out of range ({text[:32]})")
    return value


def _parse_constant(name: str) -> float:
    raise _Refused(f"{name} is not a JSON value")


def _object(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"duplicate key {shorten(key)}")
        out[key] = value
    return out


def loads(raw: bytes | str, what: str) -> object:
    """Parse `raw` (the contents of the file named `what`) or raise AdapterError."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray, memoryview)) else raw
    except UnicodeDecodeError as exc:
        raise AdapterError(f"{what} is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant,
                           object_pairs_hook=_object)
    except _Refused as exc:
        raise AdapterError(f"{what}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise AdapterError(f"{what} is nested more than {MAX_DEPTH} levels deep") from None
    if _depth(value) > MAX_DEPTH:
        raise AdapterError(f"{what} is nested more than {MAX_DEPTH} levels deep")
    return value


def _depth(value: object) -> int:
    """The nesting depth, walked without recursion (json stops near 1000 levels)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            break
        stack.extend((child, depth + 1) for child in node)
    return deepest


def shorten(value: object, limit: int = 64) -> str:
    """repr(value) cut to `limit` characters: a file-supplied name in a message, never a whole file."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
