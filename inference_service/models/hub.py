"""Hugging Face model ids (`org/name`) resolved through the standard Hugging Face cache, offline first.

The cache is huggingface_hub's own (HF_HOME / HF_HUB_CACHE): a model fetched once with
`hf download` (or by transformers) serves from there without the network. Only when the id is not
in the cache and the hub is not marked offline (HF_HUB_OFFLINE) is it downloaded; offline, or when
the download fails, the error says how to fetch it. `revision` pins a branch, tag or commit.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from adapter_cache.errors import FailedPreconditionError

log = logging.getLogger(__name__)

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
# What serving needs from a model repo (not its other formats: *.bin, *.gguf, onnx/, ...).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


def looks_like_repo_id(spec: str) -> bool:
    return REPO_ID.fullmatch(spec) is not None and ".." not in spec


def resolve_repo(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot directory of `repo_id` at `revision` (default: main)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    rev = revision or "main"
    fetch = f"hf download {repo_id} --revision {rev}  (cache: {constants.HF_HUB_CACHE})"
    try:
        path = Path(snapshot_download(repo_id, revision=rev, local_files_only=True))
        log.info("%s@%s: from the Hugging Face cache, %s", repo_id, rev, path)
        return path
    except LocalEntryNotFoundError:
        pass
    if constants.HF_HUB_OFFLINE:
        raise FailedPreconditionError(
            f"{repo_id}@{rev} is not in the Hugging Face cache and the hub is offline (HF_HUB_OFFLINE); "
            f"fetch it where the hub is reachable: {fetch}") from None
    log.info("%s@%s: not in the Hugging Face cache, downloading", repo_id, rev)
    try:
        return Path(snapshot_download(repo_id, revision=rev, allow_patterns=ALLOW_PATTERNS))
    except Exception as exc:  # noqa: BLE001 - any hub failure gets the same actionable message
        raise FailedPreconditionError(
            f"{repo_id}@{rev} is not in the Hugging Face cache and could not be downloaded "
            f"({type(exc).__name__}: {' '.join(str(exc).split())}); fetch it with: {fetch}") from None
