"""`loraplex-cache`: run the adapter-cache sidecar. Every flag has a LORAPLEX_CACHE_* env twin."""

from __future__ import annotations

import argparse
import grp
import logging
import os
import re
import signal
import sys
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health

from adapter_cache.auth import CacheAuth
from adapter_cache.env_flags import add_env_flag
from adapter_cache.metrics import CacheMetrics
from adapter_cache.server import build_server
from adapter_cache.stager import CacheConfig, Stager
from adapter_cache.store import FetchConfig, S3Config

log = logging.getLogger("adapter_cache")
ENV_PREFIX = "LORAPLEX_CACHE_"
_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30}


def parse_bytes(text: str) -> int:
    """'1073741824', '512MiB', '8GiB', '2G' -> bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]i?)?[bB]?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}")
    return int(match[1]) * _UNITS[(match[2] or "").lower()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loraplex-cache",
        description="Adapter-cache sidecar: fetches PEFT adapters from object stores into a shared-memory "
        "directory and leases them to the inference service. Every flag can also be set through the "
        f"environment as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}CAPACITY_BYTES); --allow-prefix takes a "
        "comma-separated list there.",
    )

    def add(flag: str, default: object, help: str, **kw: object) -> None:
        add_env_flag(p, ENV_PREFIX, f"--{flag}", help, default=default, **kw)

    add("listen", "unix:///tmp/loraplex/adapter-cache.sock", "unix:///path (default) or HOST:PORT for TCP")
    add("shm-dir", "/dev/shm/loraplex-adapters", "directory (tmpfs) where staged adapters live")
    add("capacity-bytes", "8GiB", "byte budget of the host cache", type=parse_bytes)
    add("allow-prefix", [], "URI prefix adapters may be fetched from (repeatable), e.g. s3://bucket/adapters, "
        "file:///models/adapters; anything else is PERMISSION_DENIED", action="append")
    add("max-adapter-bytes", "2GiB", "largest adapter_model.safetensors accepted", type=parse_bytes)
    add("max-rank", "256", "largest LoRA rank accepted", type=int)
    add("default-lease-seconds", "600", "lease length when a Stage call asks for none", type=float)
    add("max-lease-seconds", "900", "longest lease granted (longer requests are cut to this)", type=float)
    add("max-leases-per-client", "256", "live leases one caller may hold (more: RESOURCE_EXHAUSTED)", type=int)
    add("token-file", None, "file of bearer tokens (one per line) Stage/Read/Release must present; unset: any "
        "caller the socket's mode lets connect (required for a TCP --listen)")
    add("admin-token-file", None, "file of bearer tokens (one per line) List/Evict must present; unset: "
        "List/Evict are refused")
    add("group", None, "group (name or gid) that may also use the socket (0660) and read staged files (0640); "
        "unset: the sidecar's user only (0600)")
    add("part-bytes", "8MiB", "size of one ranged GET", type=parse_bytes)
    add("fetch-concurrency", "8", "ranged GETs in flight at once", type=int)
    add("fetch-attempts", "4", "attempts per GET on retryable errors (jittered exponential backoff)", type=int)
    add("fetch-deadline-seconds", "240", "overall time one adapter's fetch may take, retries included "
        "(past it: UNAVAILABLE)", type=float)
    add("backoff-initial-seconds", "0.1", "first retry backoff", type=float)
    add("backoff-max-seconds", "2.0", "largest retry backoff", type=float)
    add("connect-timeout-seconds", "5", "per-request connect timeout", type=float)
    add("read-timeout-seconds", "30", "per-request read timeout", type=float)
    add("s3-endpoint-url", None, "S3 endpoint; unset: boto3's own (AWS_ENDPOINT_URL, AWS config files)")
    add("s3-addressing-style", "path", "S3 addressing style: path, virtual or auto")
    add("no-mlock", False, "do not lock staged files in RAM", action="store_true")
    add("no-http", False, "disable http(s):// sources", action="store_true")
    add("metrics-port", "0", "Prometheus port (0: off)", type=int)
    add("metrics-addr", "0.0.0.0", "Prometheus bind address")
    add("log-level", "INFO", "logging level")
    return p


def parse_group(value: str | None) -> int | None:
    if not value:
        return None
    return int(value) if value.isdigit() else grp.getgrnam(value).gr_gid


def config_from_args(args: argparse.Namespace) -> CacheConfig:
    return CacheConfig(
        shm_dir=args.shm_dir,
        capacity_bytes=args.capacity_bytes,
        allow_prefixes=args.allow_prefix,
        max_adapter_bytes=args.max_adapter_bytes,
        max_rank=args.max_rank,
        default_lease_s=args.default_lease_seconds,
        max_lease_s=args.max_lease_seconds,
        max_leases_per_client=args.max_leases_per_client,
        group=parse_group(args.group),
        lock_memory=not args.no_mlock,
        enable_http=not args.no_http,
        fetch=FetchConfig(
            part_bytes=args.part_bytes,
            concurrency=args.fetch_concurrency,
            attempts=args.fetch_attempts,
            backoff_initial_s=args.backoff_initial_seconds,
            backoff_max_s=args.backoff_max_seconds,
            deadline_s=args.fetch_deadline_seconds,
        ),
        s3=S3Config(
            endpoint_url=args.s3_endpoint_url or None,
            addressing_style=args.s3_addressing_style,
            connect_timeout_s=args.connect_timeout_seconds,
            read_timeout_s=args.read_timeout_seconds,
            max_pool_connections=max(10, 2 * args.fetch_concurrency),
        ),
    )


UNIX_PATH_MAX = 107  # sun_path's 108 bytes, its closing NUL included


def listen_securely(stager: Stager, listen: str, auth: CacheAuth,
                    group: int | None) -> tuple[grpc.Server, health.HealthServicer]:
    """Bind `listen`; a unix socket is created 0600 (0660 for `group`), never wider even for an
    instant, in a directory this creates 0700 (0750)."""
    if not listen.startswith("unix://"):
        return build_server(stager, listen, auth)
    sock = Path(listen[len("unix://"):])
    if not sock.parent.is_dir():
        sock.parent.mkdir(parents=True, mode=0o700 if group is None else 0o750)
        if group is not None:
            os.chown(sock.parent, -1, group)
    sock.unlink(missing_ok=True)  # a stale socket from a killed predecessor
    mode = 0o600 if group is None else 0o660
    old_umask = os.umask(0o777 & ~mode)  # at start-up, before any other thread creates files
    try:
        built = build_server(stager, listen, auth)
    finally:
        os.umask(old_umask)
    if group is not None:
        os.chown(sock, -1, group)
    os.chmod(sock, mode)
    return built


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.allow_prefix:
        log.warning("no --allow-prefix given: every Stage call will be PERMISSION_DENIED")
    try:
        auth = CacheAuth.from_files(args.token_file, args.admin_token_file)
        group = parse_group(args.group)
    except (OSError, ValueError, KeyError) as exc:
        parser.error(str(exc))
    if not args.listen.startswith("unix://") and not auth.tokens_required:
        parser.error(f"--listen {args.listen} is not a unix socket, whose file mode limits who connects: "
                     "give --token-file so callers must authenticate")
    if args.listen.startswith("unix://") and len(os.fsencode(args.listen[len("unix://"):])) > UNIX_PATH_MAX:
        parser.error(f"--listen {args.listen}: a unix socket's path holds at most {UNIX_PATH_MAX} bytes "
                     "(Linux's sun_path); choose a shorter path")
    metrics = CacheMetrics()
    if args.metrics_port:  # first: a port in use is one line, with nothing created yet (the socket)
        try:
            metrics.serve(args.metrics_port, args.metrics_addr)
        except OSError as exc:
            sys.exit(f"{parser.prog}: error: metrics port {args.metrics_addr}:{args.metrics_port}: "
                     f"{exc.strerror or exc}")
    stager = Stager(config_from_args(args), metrics)
    server, health_servicer = listen_securely(stager, args.listen, auth, group)
    server.start()
    log.info("adapter cache serving on %s (shm %s, capacity %d bytes, metrics port %s, allow %s)",
             args.listen, args.shm_dir, args.capacity_bytes, args.metrics_port or "off", args.allow_prefix)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # A signal ignored when the process started stays ignored: whoever started it so stops it
        # itself. `make run`'s script starts the sidecar in the background, where bash ignores SIGINT,
        # and stops it after the server: had the sidecar ended on the terminal's Ctrl-C too, the
        # script could find it gone before its own trap ran and report a part that died (exit 1).
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down")
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=5).wait()
    stager.close()


if __name__ == "__main__":
    main()
