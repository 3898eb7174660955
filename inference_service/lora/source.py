"""Where adapter bytes come from. Runs on host-loader threads, never on the scheduler thread."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlparse

from inference_service.errors import InvalidArgumentError, PermissionDeniedError
from inference_service.lora.adapter import (
    WEIGHTS_FILE,
    BaseModelShapes,
    HostAdapter,
    load_adapter_dir,
)


class AdapterSource(Protocol):
    def fetch(self, uri: str, sha256: str | None) -> HostAdapter:
        """Validated host tensors for the adapter at `uri`; raises LoraplexError subclasses.

        The returned adapter's `tier` says where the bytes came from (cache | store)."""


def local_path(uri: str) -> Path:
    """file:///abs/dir or a plain path → a normalised absolute path."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise PermissionDeniedError(f"file URI with a remote host is not allowed: {uri}")
        raw = unquote(parsed.path)
    elif parsed.scheme == "":
        raw = uri
    else:
        raise InvalidArgumentError(f"unsupported adapter URI scheme {parsed.scheme!r} (no sidecar configured)")
    if ".." in Path(raw).parts:
        raise PermissionDeniedError(f"path traversal ('..') in adapter URI: {uri}")
    return Path(os.path.realpath(raw))


class LocalDirectorySource:
    """PEFT directories on the local filesystem (file:// URIs or plain paths)."""

    def __init__(self, shapes: BaseModelShapes, max_rank: int) -> None:
        self.shapes, self.max_rank = shapes, max_rank

    def fetch(self, uri: str, sha256: str | None) -> HostAdapter:
        path = local_path(uri)
        adapter = load_adapter_dir(path, self.shapes, self.max_rank)
        if sha256 is not None:
            digest = hashlib.sha256(bytes(adapter.keepalive)).hexdigest()  # type: ignore[arg-type]
            if digest != sha256.lower():
                raise InvalidArgumentError(f"{WEIGHTS_FILE} sha256 {digest} does not match the expected {sha256}")
        adapter.tier = "store"
        return adapter
