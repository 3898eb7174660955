"""Staged files in the shared-memory directory: crash-safe writes, mmap, mlock, recovery.

Layout, per entry (key = sha256 of the uri): `<key>.safetensors` (the adapter's bytes,
verbatim) and `<key>.json` (uri, checksum, sha256 when one was verified, size, config, last
use). Both are written under a temp name, fsynced, then renamed; the JSON is renamed last, so
it is the commit point: an entry without its JSON, or whose bytes do not match its checksum,
is never served.

The checksum guards against torn or corrupted files, not against a malicious store (that is
what a caller's pinned sha256 is for): xxh3-128 of each fixed-size part, computed in parallel
as parts land, then of the part digests in order. It runs at ~10 GB/s, where sha256 (serial,
1.3 GB/s here) would cost more CPU than the download itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import logging
import mmap
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

log = logging.getLogger(__name__)

DATA_SUFFIX = ".safetensors"
META_SUFFIX = ".json"
TMP_MARK = ".tmp-"
_HASH_CHUNK = 16 << 20

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def entry_key(uri: str) -> str:
    return hashlib.sha256(uri.encode()).hexdigest()[:40]


def sha256_of(buf: memoryview | bytes) -> str:
    h = hashlib.sha256()
    view = memoryview(buf)
    for start in range(0, len(view), _HASH_CHUNK):
        h.update(view[start : start + _HASH_CHUNK])
    return h.hexdigest()


class PartChecksum:
    """The entry checksum, fed one whole part at a time in any order (parts are `part_bytes`
    long, the last one shorter) and finished once every byte of the object is in."""

    def __init__(self, part_bytes: int) -> None:
        self.part_bytes = part_bytes
        self._parts: dict[int, bytes] = {}

    def add(self, offset: int, data: bytes | memoryview) -> None:
        assert offset % self.part_bytes == 0 and len(data) <= self.part_bytes, (offset, len(data))
        self._parts[offset] = xxhash.xxh3_128_digest(data)  # dict writes are atomic under the GIL

    def hexdigest(self, size: int) -> str:
        offsets = list(range(0, max(size, 1), self.part_bytes))  # an empty object is one empty part
        if sorted(self._parts) != offsets:
            raise RuntimeError(f"checksum has {len(self._parts)} of {len(offsets)} parts")
        combined = xxhash.xxh3_128()
        for offset in offsets:
            combined.update(self._parts[offset])
        combined.update(size.to_bytes(8, "little"))
        return combined.hexdigest()


def checksum_of(buf: memoryview | bytes, part_bytes: int) -> str:
    view = memoryview(buf)
    checksum = PartChecksum(part_bytes)
    for start in range(0, max(len(view), 1), part_bytes):
        checksum.add(start, view[start : start + part_bytes])
    return checksum.hexdigest(len(view))


@dataclass
class StoredMeta:
    """What is written beside an entry so a restarted sidecar can serve it warm."""

    uri: str
    checksum: str  # see PartChecksum
    checksum_part_bytes: int
    sha256: str  # "" unless a caller pinned one and it was verified
    size: int
    config_json: str
    last_used: float

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> StoredMeta:
        return cls(**json.loads(raw))


class PendingFile:
    """A temp file being filled by parallel ranged writes; `commit` makes it an entry."""

    def __init__(self, shm: ShmDir, uri: str, size: int) -> None:
        self.uri = uri
        self.size = size
        self.key = entry_key(uri)
        self.tmp_path = shm.root / f"{self.key}{DATA_SUFFIX}{TMP_MARK}{uuid.uuid4().hex[:8]}"
        self._shm = shm
        self.fd = shm.open_new(self.tmp_path, os.O_RDWR)
        os.ftruncate(self.fd, size)

    def pwrite(self, data: bytes | memoryview, offset: int) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n

    def map(self) -> mmap.mmap:
        """Read-only mapping of what was written so far (for hashing and validation)."""
        os.fsync(self.fd)
        return mmap.mmap(self.fd, self.size, prot=mmap.PROT_READ) if self.size else mmap.mmap(-1, 1)

    def commit(self, meta: StoredMeta) -> Path:
        """fsync, rename the data into place, then write the metadata (the commit point)."""
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        final = self._shm.data_path(self.key)
        os.rename(self.tmp_path, final)
        self._shm.write_meta(self.key, meta)
        return final

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp_path.unlink(missing_ok=True)


class ShmDir:
    """The shared-memory directory and the mlocked mappings of its entries.

    Staged files are the owner's alone (0600), or also readable by `group` (0640) when the
    inference service runs as another user of that group; a directory this creates is 0700
    (0750 with a group).
    """

    def __init__(self, root: str | Path, lock_memory: bool = True, group: int | None = None) -> None:
        self.root = Path(root)
        self.group = group
        self.file_mode = 0o600 if group is None else 0o640
        if not self.root.is_dir():
            self.root.mkdir(parents=True, mode=0o700 if group is None else 0o750)
            if group is not None:
                os.chown(self.root, -1, group)
        self.lock_memory = lock_memory
        self._locked: dict[str, mmap.mmap] = {}
        self._mlock_warned = False

    def open_new(self, path: Path, flags: int) -> int:
        """Create `path` exclusively with the staged-file mode and group (whatever the umask)."""
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, self.file_mode)
        try:
            if self.group is not None:
                os.fchown(fd, -1, self.group)
            os.fchmod(fd, self.file_mode)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return fd

    def data_path(self, key: str) -> Path:
        return self.root / f"{key}{DATA_SUFFIX}"

    def meta_path(self, key: str) -> Path:
        return self.root / f"{key}{META_SUFFIX}"

    def create(self, uri: str, size: int) -> PendingFile:
        return PendingFile(self, uri, size)

    def write_meta(self, key: str, meta: StoredMeta) -> None:
        tmp = self.root / f"{key}{META_SUFFIX}{TMP_MARK}{uuid.uuid4().hex[:8]}"
        fd = self.open_new(tmp, os.O_WRONLY)
        try:
            os.write(fd, meta.to_json())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self.meta_path(key))
        dir_fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def remove(self, uri: str) -> None:
        """Delete an entry: its metadata first, so a crash midway leaves an orphan, not a bad entry."""
        key = entry_key(uri)
        self.unlock(key)
        self.meta_path(key).unlink(missing_ok=True)
        self.data_path(key).unlink(missing_ok=True)

    def open_map(self, key: str) -> mmap.mmap:
        with open(self.data_path(key), "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            return mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ) if size else mmap.mmap(-1, 1)

    # --- RAM locking ---------------------------------------------------------------------
    def lock(self, key: str) -> bool:
        """mlock the entry's pages so staged adapters are not swapped out; False if not permitted."""
        if not self.lock_memory or key in self._locked:
            return key in self._locked
        if self.data_path(key).stat().st_size == 0:
            return True
        mm = self.open_map(key)
        view = np.frombuffer(mm, dtype=np.uint8)  # read-only buffers are fine; ctypes needs writable ones
        rc = _libc.mlock(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(len(mm)))
        del view
        if rc != 0:
            err = ctypes.get_errno()
            mm.close()
            if not self._mlock_warned:
                log.warning(
                    "mlock not permitted (%s): staged adapters stay pageable; raise RLIMIT_MEMLOCK "
                    "or grant CAP_IPC_LOCK to lock them in RAM", os.strerror(err)
                )
                self._mlock_warned = True
            return False
        self._locked[key] = mm
        return True

    def unlock(self, key: str) -> None:
        mm = self._locked.pop(key, None)
        if mm is not None:
            mm.close()  # unmapping drops the lock

    def close(self) -> None:
        for key in list(self._locked):
            self.unlock(key)

    # --- recovery ------------------------------------------------------------------------
    def recover(self) -> list[StoredMeta]:
        """Delete temp files and orphans, verify each entry's checksum, return the good ones."""
        good: list[StoredMeta] = []
        names = sorted(p.name for p in self.root.iterdir())
        for name in names:
            if TMP_MARK in name:
                log.info("deleting half-written %s left by an earlier run", name)
                (self.root / name).unlink(missing_ok=True)
        metas = {n[: -len(META_SUFFIX)] for n in names if n.endswith(META_SUFFIX) and TMP_MARK not in n}
        for name in names:
            if name.endswith(DATA_SUFFIX) and name[: -len(DATA_SUFFIX)] not in metas:
                log.info("deleting %s: no metadata (write never committed)", name)
                (self.root / name).unlink(missing_ok=True)
        for key in sorted(metas):
            try:
                meta = StoredMeta.from_json(self.meta_path(key).read_bytes())
                if entry_key(meta.uri) != key:
                    raise ValueError("metadata uri does not match its file name")
                mm = self.open_map(key)
                try:
                    ok = len(mm) == meta.size and checksum_of(mm, meta.checksum_part_bytes) == meta.checksum
                finally:
                    mm.close()
                if not ok:
                    raise ValueError("size or checksum does not match the metadata")
                for path in (self.data_path(key), self.meta_path(key)):  # staged by an older release
                    os.chmod(path, self.file_mode)
                    if self.group is not None:
                        os.chown(path, -1, self.group)
            except (OSError, ValueError, TypeError, KeyError) as exc:
                log.warning("dropping staged entry %s at restart: %s", key, exc)
                self.meta_path(key).unlink(missing_ok=True)
                self.data_path(key).unlink(missing_ok=True)
                continue
            good.append(meta)
        return good
