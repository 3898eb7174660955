"""loraplex.v1 messages ↔ the engine's types, for the gRPC front end: parsing a request strictly
(unknown fields refused), and building the responses (generated tokens, adapters) from the
engine's outputs with the generated enum values."""

from __future__ import annotations

import math
import time
from typing import Any

from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from adapter_cache.errors import InvalidArgumentError
from inference_service.api import inference_pb2 as pb
from inference_service.engine.request import FinishReason, RequestOutput
from inference_service.engine.types import AdapterInfo

FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.DEADLINE: pb.FINISH_REASON_DEADLINE,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
_STATE_PREFIX = "ADAPTER_STATE_"
# The engine's adapter states (AdapterInfo.state, the preloader's) by name → the generated enum's values.
ADAPTER_STATES: dict[str, int] = {name.removeprefix(_STATE_PREFIX): value for name, value in pb.AdapterState.items()}


def parse(message: type[Message], raw: bytes) -> Any:
    """`raw` as `message`: INVALID_ARGUMENT when it does not parse or carries a field this server
    does not implement."""
    try:
        parsed = message.FromString(raw)
    except DecodeError as e:
        raise InvalidArgumentError(
            f"malformed {message.DESCRIPTOR.name} (e.g. invalid UTF-8 in a string): {e}") from None
    unknown = _unknown_field(parsed)
    if unknown is not None:
        # protobuf keeps fields it does not know and parses on: a client built from a newer proto
        # (or a typo'd field number) would get an answer that silently ignored what it asked for.
        raise InvalidArgumentError(
            f"{message.DESCRIPTOR.name} has field number {unknown} that this server does not implement "
            "(a client built from a newer loraplex.v1 proto?)")
    return parsed


def _unknown_field(msg: Message, prefix: str = "") -> str | None:
    """The first field, as `path.number`, that `msg` (or a message inside it) carried but its type lacks."""
    unknown = UnknownFieldSet(msg)
    if len(unknown):
        return f"{prefix}{unknown[0].field_number}"
    for fd, value in msg.ListFields():
        if fd.message_type is None:
            continue
        if fd.message_type.GetOptions().map_entry:
            inner = fd.message_type.fields_by_name["value"]
            children = list(value.values()) if inner.message_type is not None else []
        else:
            children = list(value) if _is_repeated(fd) else [value]
        for child in children:
            found = _unknown_field(child, f"{prefix}{fd.name}.")
            if found is not None:
                return found
    return None


def _is_repeated(fd: Any) -> bool:
    return bool(getattr(fd, "is_repeated", False) or getattr(fd, "label", None) == fd.LABEL_REPEATED)


def generate_response(request_id: str, out: RequestOutput, index: int = 0) -> pb.GenerateResponse:
    """One engine output of sample `index` as a GenerateResponse; the last one carries usage and timings."""
    resp = pb.GenerateResponse(request_id=request_id, token_ids=out.new_token_ids, text=out.text, index=index)
    for lp in out.logprobs or ():
        resp.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                          top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
    if isinstance(out.stop_reason, str):
        resp.stop_string = out.stop_reason
    elif out.stop_reason is not None:
        resp.stop_token_id = out.stop_reason
    if out.finished:
        resp.finish_reason = FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED)  # type: ignore[arg-type]
        resp.usage.prompt_tokens = out.prompt_tokens
        resp.usage.generated_tokens = out.generated_tokens
        resp.usage.cached_tokens = out.cached_tokens
        t = out.timings
        if t is not None:
            end = t.finished or time.monotonic()
            resp.timings.queue_seconds = _since(t.arrival, t.first_scheduled)
            resp.timings.adapter_wait_seconds = _since(t.arrival, t.adapter_ready)
            resp.timings.time_to_first_token_seconds = _since(t.arrival, t.first_token)
            resp.timings.total_seconds = _since(t.arrival, end)
    return resp


def _since(start: float, end: float | None) -> float:
    return max(0.0, end - start) if end is not None and math.isfinite(end) else 0.0


def adapter_state(state: str) -> int:
    """An engine or preloader state name ("LOADED") as AdapterState (UNSPECIFIED for one the proto lacks)."""
    return ADAPTER_STATES.get(state, pb.ADAPTER_STATE_UNSPECIFIED)


def adapter_message(info: AdapterInfo, with_uri: bool = True, name: str | None = None) -> pb.Adapter:
    """`name`: what the caller knows it by (namespace.shown_name), the engine name by default."""
    return pb.Adapter(
        name=info.name if name is None else name,
        uri=info.uri if with_uri else "",
        state=adapter_state(info.state),
        slot=info.slot if info.slot is not None else -1,
        pinned=info.pinned,
        rank=info.rank or 0,
        size_bytes=info.size_bytes or 0,
        active_requests=info.active_requests,
        version=info.version or 0,
    )


def page_key(token: str) -> tuple[str, int]:
    """ListAdapters' page_token (`name@version`, as this server writes it) as its sort key."""
    name, _, version = token.rpartition("@")
    if not name or not version.isdigit() or len(token) > 160:
        raise InvalidArgumentError("page_token is not one this server returned")
    return name, int(version)


def page_token(name: str, version: int) -> str:
    return f"{name}@{version}"
