"""Object stores (s3://, file://, http(s)://) behind one small interface, the URI allow-list,
and the parallel ranged fetcher.

Every store answers one question, "bytes [start, start+len(buf)) of this object, read into buf,
and how big is it", so one fetcher can split large objects into parts for a thread pool. Parts
land in each fetch thread's reusable buffer straight from the socket or file (no intermediate
bytes objects: on a small machine the copies cost more than the network). Transient failures
raise `TransientStoreError` and are retried by tenacity with jittered exponential backoff;
everything else maps to the gRPC-facing errors of `adapter_cache.errors`.
"""

from __future__ import annotations

import http.client
import logging
import os
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

import urllib3
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from adapter_cache.errors import (
    InvalidArgumentError,
    LoraplexError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)
from adapter_cache.uri_policy import UriPolicy

log = logging.getLogger(__name__)


class TransientStoreError(UnavailableError):
    """A failure worth retrying (connection refused/reset, timeout, 5xx, throttling)."""


@dataclass(frozen=True)
class Part:
    nbytes: int  # bytes read into the buffer
    total_size: int
    etag: str | None = None


class ObjectStore(Protocol):
    def read_range(self, uri: str, start: int, buf: memoryview, etag: str | None = None) -> Part:
        """Read bytes [start, start+len(buf)) (fewer at the end) into `buf`; also the object's size.

        With `etag`, fail if the object is no longer that version (it changed mid-fetch).
        """
        ...


def _read_fully(read_into: Callable[[memoryview, int], int | None], buf: memoryview, expected: int) -> int:
    """Fill buf[:expected] with `read_into(view, filled)` calls (`filled`: bytes already read);
    fewer bytes only if the source ends early."""
    got = 0
    while got < expected:
        n = read_into(buf[got:expected], got)
        if not n:
            break
        got += n
    return got


# --- stores ---------------------------------------------------------------------------------

_RETRYABLE_S3_CODES = {"500", "502", "503", "504", "InternalError", "ServiceUnavailable", "SlowDown",
                       "RequestTimeout", "Throttling", "ThrottlingException", "RequestTimeTooSkewed"}
_NOT_FOUND_S3_CODES = {"404", "NoSuchKey", "NoSuchBucket", "NotFound"}
_DENIED_S3_CODES = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"}
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def _total_from_content_range(value: str | None, fallback: int) -> int:
    match = _CONTENT_RANGE.match(value or "")
    return int(match[3]) if match and match[3] != "*" else fallback


@dataclass
class S3Config:
    endpoint_url: str | None = None  # None: boto3's own resolution (AWS_ENDPOINT_URL, config files)
    addressing_style: str = "path"
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    max_pool_connections: int = 32


class S3Store:
    """s3://bucket/key through boto3 with the standard credential chain (env, files, web identity)."""

    def __init__(self, cfg: S3Config) -> None:
        import boto3
        from botocore.config import Config

        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=cfg.endpoint_url,
            config=Config(
                s3={"addressing_style": cfg.addressing_style},
                connect_timeout=cfg.connect_timeout_s,
                read_timeout=cfg.read_timeout_s,
                retries={"total_max_attempts": 1},  # retries are tenacity's, around the body read too
                max_pool_connections=cfg.max_pool_connections,
            ),
        )

    def read_range(self, uri: str, start: int, buf: memoryview, etag: str | None = None) -> Part:
        from botocore.exceptions import BotoCoreError, ClientError

        parsed = urllib.parse.urlparse(uri)
        bucket, key = parsed.netloc, parsed.path.lstrip("/")
        kwargs = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{start + len(buf) - 1}"}
        if etag:
            kwargs["IfMatch"] = etag
        try:
            resp = self._client.get_object(**kwargs)
            body = resp["Body"]
            length = resp.get("ContentLength")
            expected = len(buf) if length is None else min(len(buf), length)
            # The http.client response under urllib3 reads from the socket straight into buf;
            # urllib3's own readinto (the fallback) goes through an intermediate bytes object.
            raw = body._raw_stream
            reader = getattr(raw, "_fp", None) or raw
            nbytes = _read_fully(lambda view, _: reader.readinto(view), buf, expected)
            if length is not None and nbytes != expected:
                body.close()
                raise TransientStoreError(f"{uri}: connection closed after {nbytes} of {expected} bytes")
            raw.release_conn()  # the body is fully read: keep the connection for the next part
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if code == "InvalidRange" and start == 0:
                return Part(0, 0, None)  # an empty object has no byte 0
            if code in _NOT_FOUND_S3_CODES or status == "404":
                raise NotFoundError(f"{uri}: object not found ({code})") from None
            if code in _DENIED_S3_CODES or status == "403":
                raise PermissionDeniedError(f"{uri}: object store denied access ({code})") from None
            if code == "PreconditionFailed":
                raise TransientStoreError(f"{uri} changed while it was being fetched") from None
            if code in _RETRYABLE_S3_CODES or status.startswith("5"):
                raise TransientStoreError(f"{uri}: object store error {code}") from None
            raise UnavailableError(f"{uri}: object store error {code}: {exc}") from None
        except (BotoCoreError, OSError, http.client.HTTPException, urllib3.exceptions.HTTPError) as exc:
            # connection refused/reset, timeouts, a body cut short
            raise TransientStoreError(f"{uri}: object store unreachable: {exc}") from None
        total = _total_from_content_range(resp.get("ContentRange"), nbytes)
        return Part(nbytes, total, resp.get("ETag"))


class FileStore:
    """file:///path confined to the allowed roots: symlinks out of a root are refused, here at
    open time too (a link can change after the URI was checked)."""

    def __init__(self, policy: UriPolicy) -> None:
        self._policy = policy

    def read_range(self, uri: str, start: int, buf: memoryview, etag: str | None = None) -> Part:
        real = self._policy.resolve_file(urllib.parse.unquote(urllib.parse.urlparse(uri).path))
        if real is None:
            raise PermissionDeniedError(f"{uri} resolves outside every allowed file root")
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise NotFoundError(f"{uri}: file not found") from None
        except PermissionError:
            raise PermissionDeniedError(f"{uri}: not readable") from None
        try:
            st = os.fstat(fd)
            if etag and etag != f"{st.st_mtime_ns}-{st.st_size}":
                raise TransientStoreError(f"{uri} changed while it was being fetched")
            expected = max(0, min(len(buf), st.st_size - start))
            nbytes = _read_fully(lambda view, filled: os.preadv(fd, [view], start + filled), buf, expected)
            return Part(nbytes, st.st_size, f"{st.st_mtime_ns}-{st.st_size}")
        finally:
            os.close(fd)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001
        raise PermissionDeniedError(f"{req.full_url}: redirects are not followed (to {newurl})")


class HttpStore:
    """http(s):// with Range requests; redirects are refused so the allow-list cannot be escaped."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self._opener = urllib.request.build_opener(_NoRedirect)
        self._timeout = timeout_s

    def read_range(self, uri: str, start: int, buf: memoryview, etag: str | None = None) -> Part:
        headers = {"Range": f"bytes={start}-{start + len(buf) - 1}"}
        if etag:
            headers["If-Match"] = etag
        try:
            with self._opener.open(urllib.request.Request(uri, headers=headers), timeout=self._timeout) as resp:
                if resp.status == 200:  # server ignored Range: slice the whole body
                    body = resp.read()
                    data = body[start : start + len(buf)]
                    buf[: len(data)] = data
                    return Part(len(data), len(body), resp.headers.get("ETag"))
                length = resp.length if resp.length is not None else len(buf)
                nbytes = _read_fully(lambda view, _: resp.readinto(view), buf, min(len(buf), length))
                total = _total_from_content_range(resp.headers.get("Content-Range"), start + nbytes)
                return Part(nbytes, total, resp.headers.get("ETag"))
        except urllib.error.HTTPError as exc:
            if exc.code == 416 and start == 0:
                return Part(0, 0, None)
            if exc.code == 404:
                raise NotFoundError(f"{uri}: not found") from None
            if exc.code in (401, 403):
                raise PermissionDeniedError(f"{uri}: access denied ({exc.code})") from None
            if exc.code == 412:
                raise TransientStoreError(f"{uri} changed while it was being fetched") from None
            if exc.code >= 500 or exc.code == 429:
                raise TransientStoreError(f"{uri}: HTTP {exc.code}") from None
            raise UnavailableError(f"{uri}: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise TransientStoreError(f"{uri}: unreachable: {exc}") from None


# --- fetcher ----------------------------------------------------------------------------------

@dataclass
class FetchConfig:
    part_bytes: int = 8 << 20
    concurrency: int = 8
    attempts: int = 4
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 2.0


class Fetcher:
    """Ranged, parallel, retried GETs of one object into a caller-provided sink.

    Each thread that fetches keeps one part-sized buffer for its lifetime (concurrency x part
    bytes in all): a fresh buffer per part would pay its page faults every time.
    """

    def __init__(
        self,
        stores: dict[str, ObjectStore],
        cfg: FetchConfig,
        on_request: Callable[[], None] = lambda: None,
        on_bytes: Callable[[int], None] = lambda nbytes: None,
    ) -> None:
        self._stores = stores
        self._cfg = cfg
        self._on_request = on_request
        self._on_bytes = on_bytes
        self._pool = ThreadPoolExecutor(max_workers=cfg.concurrency, thread_name_prefix="fetch")
        self._local = threading.local()

    def _part_buffer(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(bytearray(self._cfg.part_bytes))
        return buf

    def _get(self, uri: str, start: int, buf: memoryview, etag: str | None = None) -> Part:
        store = self._stores.get(urllib.parse.urlparse(uri).scheme)
        if store is None:
            raise InvalidArgumentError(f"no object store configured for {uri!r}")
        retrying = Retrying(
            stop=stop_after_attempt(self._cfg.attempts),
            wait=wait_random_exponential(multiplier=self._cfg.backoff_initial_s, max=self._cfg.backoff_max_s),
            retry=retry_if_exception_type(TransientStoreError),
            before_sleep=lambda rs: log.info(
                "retrying GET %s bytes=%d+%d after: %s", uri, start, len(buf), rs.outcome.exception()
            ),
            reraise=True,
        )
        for attempt in retrying:
            with attempt:
                self._on_request()
                part = store.read_range(uri, start, buf, etag)
        self._on_bytes(part.nbytes)
        return part

    def get_small(self, uri: str, max_bytes: int) -> bytes:
        """A whole small object (adapter_config.json) in one GET."""
        buf = memoryview(bytearray(max_bytes + 1))
        part = self._get(uri, 0, buf)
        if part.total_size > max_bytes:
            raise InvalidArgumentError(f"{uri} is {part.total_size} bytes, over the limit of {max_bytes}")
        return bytes(buf[: part.nbytes])

    def fetch(
        self,
        uri: str,
        max_bytes: int,
        open_sink: Callable[[int], object],
        write: Callable[[object, memoryview, int], None],
    ) -> object:
        """GET the first part (which tells the size), check the limit, then the rest in parallel.

        `open_sink(total_size)` is called once the size is known (it reserves cache space and
        creates the temp file); `write(sink, data, offset)` stores one whole part, at an offset
        that is a multiple of the part size. `data` is only valid during the call.
        """
        part_bytes = self._cfg.part_bytes
        buf = self._part_buffer()
        first = self._get(uri, 0, buf)
        total = first.total_size
        if first.nbytes != min(part_bytes, total):
            raise UnavailableError(f"{uri}: short read of the first part (object changed?)")
        if total > max_bytes:
            raise InvalidArgumentError(f"{uri} is {total} bytes, over --max-adapter-bytes={max_bytes}")
        sink = open_sink(total)
        write(sink, buf[: first.nbytes], 0)
        starts = range(first.nbytes, total, part_bytes)
        cancelled = threading.Event()

        def one(start: int) -> None:
            if cancelled.is_set():
                return
            view = self._part_buffer()[: min(part_bytes, total - start)]
            part = self._get(uri, start, view, first.etag)
            if part.nbytes != len(view) or part.total_size != total:
                raise TransientStoreError(f"{uri}: short read at byte {start} (object changed?)")
            write(sink, view, start)

        futures = [self._pool.submit(one, s) for s in starts]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        errors = [f.exception() for f in done if f.exception() is not None]
        if errors:
            cancelled.set()
            for f in pending:
                f.cancel()
            wait(pending)
            err = errors[0]
            raise err if isinstance(err, LoraplexError) else UnavailableError(f"{uri}: fetch failed: {err}")
        return sink

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
