"""OpenAI-shaped error bodies, with the HTTP status mapped from the same LoraplexError classes
(their gRPC code names) the gRPC servicer uses: one error, one meaning on both front ends.

The mapping is Google's standard gRPC→HTTP one (google.rpc.Code), with one exception: a prompt
that cannot fit the context is a 400 (what OpenAI and vLLM answer; a 429 would make the
`openai` SDK retry a request that can never succeed).
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from adapter_cache.errors import InvalidArgumentError, LoraplexError

HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
# OpenAI's `error.type` for each status (what the openai SDK's exception classes mirror).
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout",
}
CONTEXT_TOO_LONG = "does not fit the context"  # the engine's message for a prompt that cannot fit


class BadField(InvalidArgumentError):
    """An INVALID_ARGUMENT that names the request field it is about (OpenAI's `error.param`)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def status_of(error: LoraplexError) -> int:
    if error.code == "RESOURCE_EXHAUSTED" and CONTEXT_TOO_LONG in str(error):
        return 400
    return HTTP_STATUS.get(error.code, 500)


def error_body(message: str, status: int, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPE.get(status, "error"), "param": param,
                      "code": code or status}}


def error_response(message: str, status: int, code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, code, param), status_code=status)


def loraplex_error_response(error: LoraplexError) -> JSONResponse:
    return error_response(str(error), status_of(error), error.code, getattr(error, "param", None))
