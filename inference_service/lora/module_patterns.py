"""PEFT's module-name regexes (a string `target_modules`, `rank_pattern`/`alpha_pattern` keys),
matched in linear time.

The patterns come from adapter files, so Python's backtracking `re` could be frozen by one of them
(`(.+.+)+Z` takes ages on a 30-character module path, holding the GIL). RE2 matches in time linear
in the input and refuses the constructs it cannot do so (backreferences, lookaround): such a
pattern is refused as unsupported rather than run unbounded.
"""

from __future__ import annotations

import re2

from inference_service.errors import AdapterError
from inference_service.lora.strict_json import shorten

MAX_PATTERN_CHARS = 1024
MAX_PATTERNS = 256

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # the message goes to the caller, not to stderr
_OPTIONS.max_mem = 8 << 20  # a compiled program past this is an error, not a memory hog


def compile_pattern(pattern: object, what: str) -> re2._Regexp:
    """`pattern` compiled for full matches, or AdapterError naming `what` and the problem."""
    if not isinstance(pattern, str):
        raise AdapterError(f"{what} must be a string, got {type(pattern).__name__}")
    if not pattern or len(pattern) > MAX_PATTERN_CHARS:
        raise AdapterError(f"{what} must be 1-{MAX_PATTERN_CHARS} characters, got {len(pattern)}")
    try:
        return re2.compile(pattern, _OPTIONS)
    except re2.error as exc:
        detail = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise AdapterError(
            f"{what} {shorten(pattern)} is not a supported regular expression ({shorten(str(detail), 80)}; "
            "only linear-time RE2 syntax: no backreferences or lookaround)"
        ) from None


def suffix_matcher(pattern: str, what: str) -> re2._Regexp:
    """PEFT's rule for pattern keys: the key matches the module path or a dotted suffix of it,
    `re.match(rf"(.*\\.)?({key})$", path)`."""
    compile_pattern(pattern, what)  # checks the pattern alone, so its error names it
    return compile_pattern(rf"(?:.*\.)?(?:{pattern})", what)
