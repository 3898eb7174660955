"""Errors users can hit, each carrying the gRPC status it maps to.

The engine stays free of grpc imports; the servers map `LoraplexError.code` (a
`grpc.StatusCode` member name) to the wire status.
"""

from __future__ import annotations


class LoraplexError(Exception):
    """Base class: a user-facing error with a clear message and a status code name."""

    code: str = "INTERNAL"


class InvalidArgumentError(LoraplexError):
    code = "INVALID_ARGUMENT"


class NotFoundError(LoraplexError):
    code = "NOT_FOUND"


class FailedPreconditionError(LoraplexError):
    code = "FAILED_PRECONDITION"


class ResourceExhaustedError(LoraplexError):
    code = "RESOURCE_EXHAUSTED"


class UnavailableError(LoraplexError):
    """Retryable: the sidecar or the object store could not be reached."""

    code = "UNAVAILABLE"


class PermissionDeniedError(LoraplexError):
    code = "PERMISSION_DENIED"


class UnauthenticatedError(LoraplexError):
    code = "UNAUTHENTICATED"


class AdapterError(InvalidArgumentError):
    """A malformed or unsupported adapter; nothing of it is loaded."""


class AdapterIncompatibleError(FailedPreconditionError):
    """A well-formed adapter made for a different base model (e.g. more layers than ours)."""
