"""Bounds on what a client may send, checked before any work proportional to it is done.

One place for the limits (flags in cli.py, reported by GetModelInfo, listed in docs/grpc.md), the
adapter-name and request-id grammars, and `shown()`, which makes a client-chosen string safe to log.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from adapter_cache.errors import InvalidArgumentError

# Names enter metrics labels, uids (`name@version`), logs and URIs of the sidecar's cache: no '@',
# no spaces, control, format (bidi, zero-width) or other non-ASCII characters.
ADAPTER_NAME_MAX_LEN = 128
ADAPTER_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_ADAPTER_NAME = re.compile(ADAPTER_NAME_PATTERN)
_REQUEST_ID = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces
SHOWN_MAX_CHARS = 80


@dataclass(frozen=True)
class RequestLimits:
    """Per-request input bounds (defaults are the CLI's)."""

    max_stop_strings: int = 16
    max_stop_string_length: int = 256  # characters
    max_stop_token_ids: int = 64
    max_prompt_chars: int = 262_144  # text prompts, checked before tokenization
    max_request_id_length: int = 128
    max_n: int = 16  # samples per request (OpenAI's n)


def check_adapter_name(name: str) -> None:
    """Raises INVALID_ARGUMENT unless `name` matches ADAPTER_NAME_PATTERN (the name is not echoed)."""
    if not name:
        raise InvalidArgumentError("adapter name is required")
    if len(name) > ADAPTER_NAME_MAX_LEN or not _ADAPTER_NAME.fullmatch(name):
        raise InvalidArgumentError(
            f"adapter name {shown(name)} must match {ADAPTER_NAME_PATTERN} (ASCII letters, digits, '.', '_', '-', "
            f"at most {ADAPTER_NAME_MAX_LEN} characters, starting with a letter or digit)"
        )



def adapter_name(name: str) -> str:
    """`name` if it is a valid adapter name (INVALID_ARGUMENT, without echoing it, otherwise)."""
    check_adapter_name(name)
    return name

def check_request_id(request_id: str, max_length: int) -> None:
    if len(request_id) > max_length or not _REQUEST_ID.fullmatch(request_id):
        raise InvalidArgumentError(
            f"request_id {shown(request_id)} must be 1-{max_length} printable ASCII characters without spaces"
        )


def check_n(n: int, max_n: int) -> None:
    """A request's sample count (OpenAI's `n`): 1 to --max-n."""
    if not 1 <= n <= max_n:
        raise InvalidArgumentError(f"n must be in [1, {max_n}] (--max-n), got {n}")


def check_stop(stop: Sequence[str], stop_ids_count: int, limits: RequestLimits) -> None:
    """Stop conditions are checked for every generated token: their size is bounded up front
    (the counts first, so that a huge list is refused without walking it)."""
    if len(stop) > limits.max_stop_strings:
        raise InvalidArgumentError(f"at most {limits.max_stop_strings} stop strings, got {len(stop)}")
    if stop_ids_count > limits.max_stop_token_ids:
        raise InvalidArgumentError(f"at most {limits.max_stop_token_ids} stop_token_ids, got {stop_ids_count}")
    longest = max(map(len, stop), default=0)
    if longest > limits.max_stop_string_length:
        raise InvalidArgumentError(
            f"stop strings must be at most {limits.max_stop_string_length} characters, got one of {longest}"
        )


def shown(text: str, limit: int = SHOWN_MAX_CHARS) -> str:
    """`text` as it may appear in a log line or message: as it is if short printable ASCII without
    spaces, else quoted and escaped (no CR/LF, control or bidi characters reach the log) and
    truncated, with the full length noted."""
    if len(text) <= limit and _REQUEST_ID.fullmatch(text):
        return text
    head = ascii(text[:limit])
    return head if len(text) <= limit else f"{head}...({len(text)} chars)"


PRIORITY_BOUND = 2**31 - 1  # gRPC's int32


def check_priority(priority: int) -> None:
    """A request's scheduling priority: an int32 (lower first)."""
    if isinstance(priority, bool) or not isinstance(priority, int) \
            or not -PRIORITY_BOUND - 1 <= priority <= PRIORITY_BOUND:
        raise InvalidArgumentError(f"priority must be an integer from {-PRIORITY_BOUND - 1} to {PRIORITY_BOUND}")
