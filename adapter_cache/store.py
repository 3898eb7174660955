"""Object stores (s3://, file://, http(s)://) behind one small interface, the URI allow-list,
and the parallel ranged fetcher with its overall deadline.

Every store answers one question, "bytes [start, start+len(buf)) of this object, read into buf,
and how big is it", so one fetcher can split large objects into parts for a thread pool. Parts
land in each fetch thread's reusable buffer straight from the socket or file (no intermediate
bytes objects: on a small machine the copies cost more than the network). Transient failures
raise `TransientStoreError` and are retried by tenacity with jittered exponential backoff;
everything else maps to the gRPC-facing errors of `inference_service.errors`.

What an origin sends is never trusted to be bounded: every read fills at most the caller's
buffer, an origin that ignores Range is read as one counted stream (never whole into memory),
and a fetch has an overall deadline that cuts its connections (adapter_cache.deadline).
"""

from __future__ import annotations

import http.client
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import urllib3
from tenacity import Retrying, retry_if_exception_type, wait_random_exponential

from adapter_cache.deadline import Deadline, deadline_timeout, watch_response
from inference_service.errors import (
    InvalidArgumentError,
    LoraplexError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)
from inference_service.file_access import open_regular
from inference_service.uri_policy import UriPolicy

log = logging.getLogger(__name__)


class TransientStoreError(UnavailableError):
    """A failure worth retrying (connection refused/reset, timeout, 5xx, throttling)."""


UNKNOWN_SIZE = -1  # Part.total_size of an unranged body longer than the buffer, sent without a length


@dataclass(frozen=True)
class Part:
    nbytes: int  # bytes read into the buffer
    total_size: int  # UNKNOWN_SIZE: the origin ignored Range and gave no Content-Length
    etag: str | None = None
    ranged: bool = True  # False: the origin ignored Range and sent the object from byte 0


class ObjectStore(Protocol):
    def read_range(
        self, uri: str, start: int, buf: memoryview, etag: str | None = None, deadline: Deadline | None = None
    ) -> Part:
        """Read bytes [start, start+len(buf)) (fewer at the end) into `buf`; also the object's size.

        With `etag`, fail if the object is no longer that version (it changed mid-fetch). Never
        reads more than `len(buf)` bytes of the body, whatever the origin sends.
        """
        ...


def _read_fully(read_into: Callable[[memoryview, int], int | None], buf: memoryview, expected: int,
                deadline: Deadline | None = None) -> int:
    """Fill buf[:expected] with `read_into(view, filled)` calls (`filled`: bytes already read);
    fewer bytes only if the source ends early (or the deadline cut the connection)."""
    got = 0
    while got < expected:
        if deadline is not None:
            deadline.check()
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

    def read_range(
        self, uri: str, start: int, buf: memoryview, etag: str | None = None, deadline: Deadline | None = None
    ) -> Part:
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
            with watch_response(deadline, raw):
                nbytes = _read_fully(lambda view, _: reader.readinto(view), buf, expected, deadline)
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
    """file:///path under the rule of `inference_service.file_access` (the service's local source
    follows it too): regular files only, confined to the allowed roots at open time (a link can
    change after the URI was checked)."""

    def __init__(self, policy: UriPolicy) -> None:
        self._policy = policy

    def read_range(
        self, uri: str, start: int, buf: memoryview, etag: str | None = None, deadline: Deadline | None = None
    ) -> Part:
        path = urllib.parse.unquote(urllib.parse.urlparse(uri).path)
        fd, st = open_regular(path, self._policy.file_roots, None)
        try:
            if etag and etag != f"{st.st_mtime_ns}-{st.st_size}":
                raise TransientStoreError(f"{uri} changed while it was being fetched")
            expected = max(0, min(len(buf), st.st_size - start))
            nbytes = _read_fully(lambda view, filled: os.preadv(fd, [view], start + filled), buf, expected, deadline)
            return Part(nbytes, st.st_size, f"{st.st_mtime_ns}-{st.st_size}")
        finally:
            os.close(fd)


class _EmptyObject(Exception):
    """416 on a GET from byte 0: the object is empty."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001
        raise PermissionDeniedError(f"{req.full_url}: redirects are not followed (to {newurl})")


class HttpStore:
    """http(s):// with Range requests; redirects are refused so the allow-list cannot be escaped.

    An origin that ignores Range answers 200 with the whole object: only the buffer's worth of
    it is read (the connection is then dropped), and the part says so (`ranged=False`), so the
    fetcher reads the rest as one sequential, counted stream (`stream`).
    """

    def __init__(self, timeout_s: float = 30.0) -> None:
        self._opener = urllib.request.build_opener(_NoRedirect)
        self._timeout = timeout_s

    def _open(self, uri: str, headers: dict[str, str], deadline: Deadline | None) -> http.client.HTTPResponse:
        return self._opener.open(urllib.request.Request(uri, headers=headers),
                                 timeout=deadline_timeout(self._timeout, deadline))

    def read_range(
        self, uri: str, start: int, buf: memoryview, etag: str | None = None, deadline: Deadline | None = None
    ) -> Part:
        headers = {"Range": f"bytes={start}-{start + len(buf) - 1}"}
        if etag:
            headers["If-Match"] = etag
        try:
            with self._errors(uri, start), self._open(uri, headers, deadline) as resp, watch_response(deadline, resp):
                if resp.status == 200:
                    return self._unranged(uri, resp, start, buf, deadline)
                length = resp.length if resp.length is not None else len(buf)
                nbytes = _read_fully(lambda view, _: resp.readinto(view), buf, min(len(buf), length), deadline)
                total = _total_from_content_range(resp.headers.get("Content-Range"), start + nbytes)
                return Part(nbytes, total, resp.headers.get("ETag"))
        except _EmptyObject:
            return Part(0, 0, None)

    def stream(
        self, uri: str, buf: memoryview, total: int, on_part: Callable[[int, memoryview], None],
        etag: str | None = None, deadline: Deadline | None = None,
    ) -> None:
        """GET the whole object and hand it over in `len(buf)`-sized parts, in order, reading
        exactly `total` bytes (the size the first response announced) and nothing more."""
        headers = {"If-Match": etag} if etag else {}
        with self._errors(uri, 0), self._open(uri, headers, deadline) as resp, watch_response(deadline, resp):
            if resp.status != 200 or resp.length != total:
                raise TransientStoreError(f"{uri}: whole-object GET answered {resp.status} with "
                                          f"{resp.length} bytes, expected {total} (object changed?)")
            for offset in range(0, total, len(buf)):
                view = buf[: min(len(buf), total - offset)]
                if _read_fully(lambda v, _: resp.readinto(v), view, len(view), deadline) != len(view):
                    raise TransientStoreError(f"{uri}: connection closed at byte {offset}")
                on_part(offset, view)

    @staticmethod
    def _unranged(uri: str, resp: http.client.HTTPResponse, start: int, buf: memoryview,
                  deadline: Deadline | None) -> Part:
        if start != 0:  # it honoured Range for the first part: another backend, or it changed
            raise TransientStoreError(f"{uri}: a ranged GET at byte {start} got the whole object")
        total = resp.length  # Content-Length; None for a chunked or close-delimited body
        want = len(buf) if total is None else min(len(buf), total)
        nbytes = _read_fully(lambda view, _: resp.readinto(view), buf, want, deadline)
        if total is None:
            total = nbytes if nbytes < len(buf) or not resp.read(1) else UNKNOWN_SIZE
        elif nbytes != want:
            raise TransientStoreError(f"{uri}: connection closed after {nbytes} of {want} bytes")
        return Part(nbytes, total, resp.headers.get("ETag"), ranged=False)

    @staticmethod
    @contextmanager
    def _errors(uri: str, start: int) -> Iterator[None]:
        try:
            yield
        except urllib.error.HTTPError as exc:
            if exc.code == 416 and start == 0:
                raise _EmptyObject() from None
            if exc.code == 404:
                raise NotFoundError(f"{uri}: not found") from None
            if exc.code in (401, 403):
                raise PermissionDeniedError(f"{uri}: access denied ({exc.code})") from None
            if exc.code == 412:
                raise TransientStoreError(f"{uri} changed while it was being fetched") from None
            if exc.code >= 500 or exc.code == 429:
                raise TransientStoreError(f"{uri}: HTTP {exc.code}") from None
            raise UnavailableError(f"{uri}: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise TransientStoreError(f"{uri}: unreachable: {exc}") from None


# --- fetcher ----------------------------------------------------------------------------------

@dataclass
class FetchConfig:
    part_bytes: int = 8 << 20
    concurrency: int = 8
    attempts: int = 4
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 2.0
    deadline_s: float = 240.0  # one adapter's config and weights, retries included


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

    def deadline(self, what: str) -> Deadline:
        """A deadline for everything one adapter's fetch does; `cancel()` it when done."""
        return Deadline(self._cfg.deadline_s, what)

    def _part_buffer(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(bytearray(self._cfg.part_bytes))
        return buf

    def _store(self, uri: str) -> ObjectStore:
        store = self._stores.get(urllib.parse.urlparse(uri).scheme)
        if store is None:
            raise InvalidArgumentError(f"no object store configured for {uri!r}")
        return store

    def _retried(self, what: str, deadline: Deadline, call: Callable[[], Part | None]) -> Part | None:
        """`call` with jittered retries on transient errors, none of them past the deadline."""
        retrying = Retrying(
            stop=lambda rs: rs.attempt_number >= self._cfg.attempts or deadline.remaining() <= 0,
            wait=wait_random_exponential(multiplier=self._cfg.backoff_initial_s, max=self._cfg.backoff_max_s),
            sleep=lambda seconds: time.sleep(max(0.0, min(seconds, deadline.remaining()))),
            retry=retry_if_exception_type(TransientStoreError),
            before_sleep=lambda rs: log.info("retrying %s after: %s", what, rs.outcome.exception()),
            reraise=True,
        )
        for attempt in retrying:
            with attempt:
                deadline.check()
                self._on_request()
                try:
                    return call()
                except TransientStoreError:
                    deadline.check()  # a read the deadline cut reports the deadline, not a retryable error
                    raise
        raise AssertionError("unreachable: Retrying reraises")

    def _get(self, uri: str, start: int, buf: memoryview, deadline: Deadline, etag: str | None = None) -> Part:
        store = self._store(uri)
        part = self._retried(f"GET {uri} bytes={start}+{len(buf)}", deadline,
                             lambda: store.read_range(uri, start, buf, etag, deadline))
        self._on_bytes(part.nbytes)
        return part

    def get_small(self, uri: str, max_bytes: int, deadline: Deadline) -> bytes:
        """A whole small object (adapter_config.json) in one GET."""
        buf = memoryview(bytearray(max_bytes + 1))
        part = self._get(uri, 0, buf, deadline)
        if part.total_size == UNKNOWN_SIZE or part.total_size > max_bytes:
            raise InvalidArgumentError(f"{uri} is over the limit of {max_bytes} bytes")
        return bytes(buf[: part.nbytes])

    def fetch(
        self,
        uri: str,
        max_bytes: int,
        open_sink: Callable[[int], object],
        write: Callable[[object, memoryview, int], None],
        deadline: Deadline,
    ) -> object:
        """GET the first part (which tells the size), check the limit, then the rest in parallel.

        `open_sink(total_size)` is called once the size is known (it reserves cache space and
        creates the temp file); `write(sink, data, offset)` stores one whole part, at an offset
        that is a multiple of the part size. `data` is only valid during the call. No more than
        `max_bytes` of the body are ever read, whatever the origin announces or sends.
        """
        part_bytes = self._cfg.part_bytes
        buf = self._part_buffer()
        first = self._get(uri, 0, buf, deadline)
        total = first.total_size
        if total == UNKNOWN_SIZE:
            raise InvalidArgumentError(
                f"{uri}: the origin ignores Range requests and sends no Content-Length, and the body is "
                f"longer than one part ({part_bytes} bytes): its size cannot be bounded by "
                f"--max-adapter-bytes={max_bytes} before it is read"
            )
        if total > max_bytes:
            raise InvalidArgumentError(f"{uri} is {total} bytes, over --max-adapter-bytes={max_bytes}")
        if first.nbytes != min(part_bytes, total):
            raise UnavailableError(f"{uri}: short read of the first part (object changed?)")
        sink = open_sink(total)
        write(sink, buf[: first.nbytes], 0)
        if not first.ranged:
            if total > first.nbytes:
                self._stream_rest(uri, sink, write, first, deadline)
            return sink
        starts = range(first.nbytes, total, part_bytes)
        cancelled = threading.Event()

        def one(start: int) -> None:
            if cancelled.is_set():
                return
            view = self._part_buffer()[: min(part_bytes, total - start)]
            part = self._get(uri, start, view, deadline, first.etag)
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

    def _stream_rest(self, uri: str, sink: object, write: Callable[[object, memoryview, int], None],
                     first: Part, deadline: Deadline) -> None:
        """An origin that ignores Range: read the object once more as one stream, in order, and
        write the parts after the first (a retry skips what an earlier attempt wrote)."""
        stream = getattr(self._store(uri), "stream", None)
        if stream is None:
            raise UnavailableError(f"{uri}: the store answered a ranged GET with the whole object")
        log.info("%s: the origin ignores Range requests; reading it as one stream", uri)
        written = first.nbytes

        def on_part(offset: int, view: memoryview) -> None:
            nonlocal written
            self._on_bytes(len(view))
            if offset >= written:
                write(sink, view, offset)
                written = offset + len(view)

        buf = self._part_buffer()
        self._retried(f"GET {uri} (whole object)", deadline,
                      lambda: stream(uri, buf, first.total_size, on_part, first.etag, deadline))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
