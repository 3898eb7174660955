"""`loraplex-inference`: the gRPC inference server.

Every flag has an environment variable mirror, LORAPLEX_<FLAG> (dashes as underscores;
repeatable flags take a comma-separated list, switches take 1/true/yes). Flags win over
the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from adapter_cache.env_flags import add_env_flag, env_name
from adapter_cache.errors import LoraplexError
from adapter_cache.uri_policy import UriPolicy
from inference_service.auth import is_loopback_listen, read_token_file
from inference_service.config import EngineConfig
from inference_service.server import ServerConfig

log = logging.getLogger("loraplex.cli")
ENV_PREFIX = "LORAPLEX_"


def _env_name(flag: str) -> str:
    return env_name(ENV_PREFIX, flag)


def _add(parser: argparse.ArgumentParser | Any, flag: str, help: str, **kw: Any) -> None:
    add_env_flag(parser, ENV_PREFIX, flag, help, **kw)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loraplex-inference",
        description="Serve one base LLM with many LoRA adapters over gRPC (loraplex.v1.Inference).",
        epilog="Every flag can also be set through the environment variable shown with it.",
    )
    g = p.add_argument_group("model and engine")
    _add(g, "--model", "HF checkpoint directory, or builtin:tiny (a small random LLaMA)", default="builtin:tiny")
    _add(g, "--device", "auto | cpu | cuda | cuda:N", default="auto")
    _add(g, "--dtype", "float32 | float16 | bfloat16", default="float32",
         choices=("float32", "float16", "bfloat16"))
    _add(g, "--max-loras", "LoRA slots on the device", type=int, default=EngineConfig.max_loras)
    _add(g, "--max-lora-rank", "largest adapter rank accepted", type=int, default=EngineConfig.max_lora_rank)
    _add(g, "--kv-cache-bytes", "KV cache size in bytes (default: what the memory budget leaves)", type=int)
    _add(g, "--max-num-seqs", "running requests per scheduler step", type=int,
         default=EngineConfig.max_num_seqs)
    _add(g, "--max-num-batched-tokens", "token budget per scheduler step", type=int,
         default=EngineConfig.max_num_batched_tokens)
    _add(g, "--max-queue", "waiting requests before RESOURCE_EXHAUSTED", type=int,
         default=EngineConfig.max_queue)
    _add(g, "--max-new-tokens-limit", "largest max_new_tokens a request may ask for", type=int,
         default=EngineConfig.max_new_tokens_limit)
    _add(g, "--default-max-new-tokens", "max_new_tokens of requests that leave it unset", type=int,
         default=ServerConfig.default_max_new_tokens)
    _add(g, "--seed", "seeds sampling for requests that set no seed of their own", type=int,
         default=EngineConfig.seed)

    g = p.add_argument_group("adapters")
    _add(g, "--cache-address",
         "adapter-cache sidecar address (unix:///path or host:port); unset: read file:// URIs directly")
    _add(g, "--preload-file", "YAML or JSON list of {name, uri, pinned} adapters loaded before serving")
    _add(g, "--host-cache-bytes", "validated adapters from local directories kept in host memory, so one "
         "evicted from its slot is copied back without being read again (0: off)", type=int,
         default=EngineConfig.host_cache_bytes)
    _add(g, "--adapter-source-allow",
         "allowed adapter URI prefix, e.g. s3://bucket/adapters/ or file:///srv/adapters (repeatable; "
         "none: any URI)", action="append", default=[])

    g = p.add_argument_group("serving")
    _add(g, "--listen", "HOST:PORT or unix:///path", default=ServerConfig.listen)
    _add(g, "--metrics-port", "Prometheus /metrics port (0: off)", type=int, default=0)
    _add(g, "--metrics-addr", "address the /metrics endpoint binds", default=ServerConfig.metrics_addr)
    _add(g, "--adapter-metrics-top-k",
         "adapters with their own label in loraplex_adapter_requests_total (the rest: adapter=\"other\")",
         type=int, default=ServerConfig.adapter_metrics_top_k)
    _add(g, "--max-message-bytes", "largest gRPC message accepted or sent", type=int,
         default=ServerConfig.max_message_bytes)
    _add(g, "--log-level", "DEBUG | INFO | WARNING | ERROR", default="INFO")

    g = p.add_argument_group("security")
    _add(g, "--admin-token-file",
         "file holding the bearer token LoadAdapter/UnloadAdapter require (or set LORAPLEX_ADMIN_TOKEN)")
    _add(g, "--insecure-admin",
         "allow listening on a non-loopback address with unauthenticated admin RPCs", action="store_true")
    _add(g, "--tls-cert", "server certificate (PEM); enables TLS")
    _add(g, "--tls-key", "server private key (PEM)")
    _add(g, "--tls-client-ca", "CA (PEM) client certificates must chain to; enables mTLS")
    return p


def load_preload_file(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if isinstance(data, dict) and "adapters" in data:
        data = data["adapters"]
    if not isinstance(data, list) or not all(isinstance(e, dict) and "name" in e and "uri" in e for e in data):
        raise ValueError(f"{path}: expected a list of {{name, uri, pinned}} entries")
    return data


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """EngineConfig and ServerConfig from parsed flags; raises ValueError on an unsafe setup."""
    token = os.environ.get("LORAPLEX_ADMIN_TOKEN") or None
    if args.admin_token_file:
        token = read_token_file(args.admin_token_file)
    allow = tuple(args.adapter_source_allow)
    UriPolicy(allow)  # reject malformed prefixes at startup
    if not is_loopback_listen(args.listen) and token is None and not args.insecure_admin:
        raise ValueError(
            f"refusing to listen on non-loopback {args.listen} without an admin token: set "
            "--admin-token-file or LORAPLEX_ADMIN_TOKEN, or pass --insecure-admin"
        )
    engine_cfg = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_queue=args.max_queue,
        max_new_tokens_limit=args.max_new_tokens_limit,
        cache_address=args.cache_address,
        host_cache_bytes=args.host_cache_bytes,
        seed=args.seed,
    )
    server_cfg = ServerConfig(
        listen=args.listen,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        admin_token=token,
        insecure_admin=args.insecure_admin,
        adapter_source_allow=allow,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        max_message_bytes=args.max_message_bytes,
        default_max_new_tokens=args.default_max_new_tokens,
        adapter_metrics_top_k=args.adapter_metrics_top_k,
        preload=load_preload_file(args.preload_file) if args.preload_file else [],
    )
    return engine_cfg, server_cfg


async def _serve_until_signal(engine: Any, server_cfg: ServerConfig, sink: Any) -> None:
    from inference_service.server import serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await serve(engine, server_cfg, sink, stop=stop)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        engine_cfg, server_cfg = configs_from_args(args)
    except (ValueError, OSError, LoraplexError) as e:
        parser.error(str(e))

    from inference_service.engine import Engine
    from inference_service.metrics import EngineCollector, build_registry, serve_metrics

    registry, sink = build_registry(server_cfg.adapter_metrics_top_k)
    engine = Engine(engine_cfg, metrics=sink)
    registry.register(EngineCollector(engine.stats))
    engine.start()
    metrics_server = None
    try:
        if server_cfg.metrics_port:
            metrics_server = serve_metrics(registry, server_cfg.metrics_port, server_cfg.metrics_addr)
            print(f"METRICS http://{server_cfg.metrics_addr}:{server_cfg.metrics_port}/metrics", flush=True)
        asyncio.run(_serve_until_signal(engine, server_cfg, sink))
    except (RuntimeError, LoraplexError) as e:
        log.error("%s", e)
        return 1
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
