"""`loraplex-inference`: the gRPC inference server.

Every flag has an environment variable mirror, LORAPLEX_<FLAG> (dashes as underscores;
repeatable flags take a comma-separated list, switches take 1/true/yes). Flags win over
the environment. The flags are declared once, in serve_flags.ServeFlags; this module checks
them, builds the configs and serves.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from adapter_cache.auth import read_tokens
from adapter_cache.errors import LoraplexError
from adapter_cache.uri_policy import UriPolicy
from inference_service.engine.client import EngineClient
from inference_service.engine.config import EngineConfig
from inference_service.flags import build_parser as build_flag_parser
from inference_service.flags import from_namespace, settings_for
from inference_service.frontend.adapter_resolver import check_template
from inference_service.frontend.auth import admin_disabled_reason, read_token_file
from inference_service.frontend.config import ServerConfig
from inference_service.frontend.http.config import HttpConfig
from inference_service.frontend.preload import PreloadEntry, read_preload_file
from inference_service.frontend.tenants import read_tenants_file
from inference_service.limits import RequestLimits
from inference_service.serve_flags import ServeFlags

log = logging.getLogger("loraplex.cli")
ENV_PREFIX = "LORAPLEX_"


def lora_module_entries(modules: Sequence[tuple[str, str]]) -> list[PreloadEntry]:
    """--lora-modules as preload entries (required: readiness waits for them); each directory must
    exist now (a usage error at start, not a load failing later)."""
    entries = []
    for name, path in modules:
        root = Path(path).expanduser().resolve()
        if not root.is_dir():
            raise ValueError(f"--lora-modules {name}={path}: no such directory")
        entries.append(PreloadEntry(name=name, uri=root.as_uri(), required=True))
    return entries


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line (the whole usage of this many flags would bury the cause)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every ServeFlags field (their environment mirrors read now)."""
    return build_flag_parser(ServeFlags, _Parser(
        prog="loraplex-inference",
        description="Serve one base LLM with many LoRA adapters over gRPC (loraplex.v1.Inference).",
        epilog="Every flag can also be set through the environment variable shown with it.",
    ), ENV_PREFIX)


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """EngineConfig and ServerConfig from parsed flags; raises ValueError on an unsafe setup."""
    flags = from_namespace(ServeFlags, args)
    token = os.environ.get("LORAPLEX_ADMIN_TOKEN") or None
    if flags.admin_token_file:
        token = read_token_file(flags.admin_token_file)
    if flags.cache_token_file:
        read_tokens(flags.cache_token_file)  # unreadable or empty: a usage error now, not at the first load
    modules = lora_module_entries(flags.lora_modules)
    allow = tuple(flags.adapter_source_allow) + tuple(e.uri for e in modules
                                                      if e.uri not in flags.adapter_source_allow)
    UriPolicy(allow)  # reject malformed prefixes at startup
    if flags.adapter_resolver:
        check_template(flags.adapter_resolver)
        if not allow:
            raise ValueError("--adapter-resolver needs --adapter-source-allow covering its URIs")
    if flags.shutdown_grace_s < 0 or flags.drain_delay_s < 0 or flags.watchdog_stall_s < 0:
        raise ValueError("--shutdown-grace-s, --drain-delay-s and --watchdog-stall-s must be >= 0")
    if flags.stream_interval < 1:
        raise ValueError("--stream-interval must be >= 1")
    if flags.max_n < 1:
        raise ValueError("--max-n must be >= 1")
    if flags.max_loras != "auto" and flags.lora_memory_bytes is not None:
        raise ValueError("--lora-memory-bytes sizes the pool of --max-loras auto; "
                         f"--max-loras {flags.max_loras} is a fixed count of slots: give one or the other")
    preload = read_preload_file(flags.preload_file) if flags.preload_file else []
    twice = sorted({e.name for e in preload} & {e.name for e in modules})
    if twice:
        raise ValueError(f"adapter {twice[0]!r} is in both --lora-modules and --preload-file")
    tenants = read_tenants_file(flags.tenants_file) if flags.tenants_file else ()
    header = (flags.trusted_tenant_header or "").strip() or None
    if header is not None and (not header.isascii() or not header.replace("-", "").isalnum()
                               or header.lower() in ("authorization", "host", "content-type")):
        raise ValueError(f"--trusted-tenant-header {header!r} is not a header name this server can trust")
    if header is not None and not any(t.via_trusted_header for t in tenants):
        raise ValueError(f"--trusted-tenant-header {header}: no tenant of --tenants-file accepts it "
                         "(via_trusted_header: true)")
    if flags.tenant_metrics_top_k < 0:
        raise ValueError("--tenant-metrics-top-k must be >= 0")
    reason = admin_disabled_reason(flags.listen, token, flags.insecure_admin)
    if reason:
        log.warning("%s", reason)
    engine_cfg = EngineConfig(
        **settings_for(flags, EngineConfig),
        adapter_source_allow=allow,
        adapter_pool_shares={t.name: t.adapter_pool_bytes for t in tenants if t.adapter_pool_bytes is not None},
        limits=RequestLimits(**settings_for(flags, RequestLimits)),
        huge_pages=flags.huge_pages == "on",
        prefix_cache=flags.prefix_cache == "on",
        fair_share=flags.fair_share == "on",
    )
    server_cfg = ServerConfig(
        **settings_for(flags, ServerConfig),
        admin_token=token,
        adapter_source_allow=allow,
        default_max_new_tokens=flags.default_max_new_tokens or None,  # 0: the rest of the context
        preload=preload,
        lora_modules=modules,
        tenants=tenants,
        trusted_tenant_header=header,
    )
    log.info("prefix cache scope: %s (%s)", server_cfg.cache_scope,
             "--prefix-cache-scope" if flags.prefix_cache_scope else
             "tenants configured: per tenant" if server_cfg.tenancy.enabled else "no tenants configured")
    return engine_cfg, server_cfg


def http_config_from_args(args: argparse.Namespace) -> HttpConfig:
    """The HTTP front end's settings; its admin routes follow the gRPC rules (admin_disabled_reason)."""
    flags = from_namespace(ServeFlags, args)
    if flags.max_model_len is not None and flags.max_model_len < 2:
        raise ValueError("--max-model-len must be >= 2")
    if flags.chat_template and not os.path.isfile(flags.chat_template):
        raise ValueError(f"--chat-template {flags.chat_template}: no such file")
    if flags.http_header_timeout_s <= 0 or flags.http_body_timeout_s <= 0 or flags.http_max_connections < 1:
        raise ValueError("--http-header-timeout-s and --http-body-timeout-s must be > 0, "
                         "--http-max-connections >= 1")
    return HttpConfig(**settings_for(flags, HttpConfig), served_model_names=tuple(flags.served_model_name))


async def _serve_until_signal(engine: EngineClient, server_cfg: ServerConfig, sink: Any, http_cfg: HttpConfig,
                              registry: Any) -> None:
    from inference_service.frontend.server import serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    front_ends = []
    from inference_service.frontend.chat_template import load_chat_template

    # One template for both APIs: HTTP's chat completions and gRPC's Generate with messages.
    template = load_chat_template(engine.config.model, http_cfg.chat_template, engine.config.revision)
    if http_cfg.port:
        from inference_service.frontend.http.app import build_app
        from inference_service.frontend.http.serving import HttpFrontEnd

        names = http_cfg.served_model_names or (engine.model_info.name,)
        app = build_app(engine, server_cfg, names, template, registry, f"{http_cfg.addr}:{http_cfg.port}",
                        http_cfg.tool_call_parser)
        front_ends.append(HttpFrontEnd(app, http_cfg))  # drains beside gRPC: same readiness, delay and grace
    await serve(engine, server_cfg, sink, stop=stop, collectors=registry, front_ends=front_ends,
                chat_template=template)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return _run(parser, args)
    except KeyboardInterrupt:  # Ctrl-C while starting (once serving, a signal handler stops the server)
        return 130


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        engine_cfg, server_cfg = configs_from_args(args)
        http_cfg = http_config_from_args(args)
        adapters_collector = server_cfg.adapters.collector()  # reads --state-dir: a damaged file stops here
    except (ValueError, OSError, LoraplexError) as e:
        parser.error(str(e))

    from inference_service.engine.heap import freeze_startup_objects
    from inference_service.engine.in_process import Engine
    from inference_service.engine.process import ProcessEngine
    from inference_service.frontend.metrics import EngineCollector, build_registry, serve_metrics
    from inference_service.frontend.platform_info import PlatformInfoCollector
    from inference_service.frontend.residency import ResidencyCollector

    registry, sink = build_registry(server_cfg.adapter_metrics_top_k)
    # The core process is forked here, before any server thread exists and before this process
    # has touched CUDA or torch's thread pool (a child forked after either cannot use them). With
    # this, torch answers cuda.is_available() from NVML, which leaves CUDA uninitialized.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:  # the model loads here: what is wrong with it is one line, exit code 2, before anything serves
        if args.engine_core == "process":
            engine: Engine | ProcessEngine = ProcessEngine(engine_cfg, metrics=sink, start_method="fork")
        else:
            engine = Engine(engine_cfg, metrics=sink)
    except (ValueError, OSError, LoraplexError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    registry.register(EngineCollector(engine.stats, server_cfg.tenant_metrics_top_k))
    registry.register(ResidencyCollector(engine, server_cfg.adapter_metrics_top_k))
    registry.register(PlatformInfoCollector(engine.model_info))
    registry.register(server_cfg.tenancy.collector())
    registry.register(adapters_collector)
    engine.start()
    # Here, not in serve(): a process that runs many servers (the tests) would keep their cycles.
    freeze_startup_objects()
    metrics_server = None
    try:
        if server_cfg.metrics_port:
            metrics_server = serve_metrics(registry, server_cfg.metrics_port, server_cfg.metrics_addr)
            print(f"METRICS http://{server_cfg.metrics_addr}:{server_cfg.metrics_port}/metrics", flush=True)
        asyncio.run(_serve_until_signal(engine, server_cfg, sink, http_cfg, registry))
    except (RuntimeError, ValueError, LoraplexError) as e:
        log.error("%s", e)
        return 1
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
