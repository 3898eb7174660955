"""A Hugging Face hub cache laid out exactly as huggingface_hub lays it out, without the network.

<cache>/models--{org}--{name}/blobs/<etag>: each file's content once, named by its etag (sha256 of
the content for LFS files such as *.safetensors, the git blob sha1 for the others);
snapshots/<commit>/<path>: relative symlinks to the blobs; refs/<branch or tag>: the commit hash.
tests/test_hf_hub_ids.py proves huggingface_hub's own readers (scan_cache_dir,
try_to_load_from_cache, snapshot_download(local_files_only=True)) see what this writes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


def _etag(relpath: str, data: bytes) -> str:
    if relpath.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id


def add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, Path], refs: tuple[str, ...] = ("main",)
                 ) -> Path:
    """Put `files` (repo path → local file) in the cache as revision `commit`, named by `refs`."""
    assert len(commit) == 40, "a commit hash is 40 hex digits"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for relpath, source in files.items():
        data = source.read_bytes()
        blob = repo / "blobs" / _etag(relpath, data)
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / relpath
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        path = repo / "refs" / ref
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(commit)
    return snapshot


def add_checkpoint(cache: Path, repo_id: str, commit: str, checkpoint: Path, refs: tuple[str, ...] = ("main",)
                   ) -> Path:
    """Every file of a checkpoint directory, as one revision."""
    files = {str(p.relative_to(checkpoint)): p for p in sorted(checkpoint.rglob("*")) if p.is_file()}
    return add_snapshot(cache, repo_id, commit, files, refs)
