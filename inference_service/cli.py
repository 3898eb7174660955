"""`loraplex-inference`: the gRPC inference server.

Every flag has an environment variable mirror, LORAPLEX_<FLAG> (dashes as underscores;
repeatable flags take a comma-separated list, switches take 1/true/yes). Flags win over
the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from adapter_cache.auth import read_tokens
from adapter_cache.env_flags import add_env_flag, env_name
from adapter_cache.errors import LoraplexError
from adapter_cache.uri_policy import UriPolicy
from inference_service.engine.client import EngineClient
from inference_service.engine.config import EngineConfig
from inference_service.frontend.adapter_resolver import check_template
from inference_service.frontend.auth import admin_disabled_reason, read_token_file
from inference_service.frontend.cache_salt import SCOPES
from inference_service.frontend.grpc_server import ServerConfig
from inference_service.frontend.http.config import HttpConfig
from inference_service.frontend.preload import read_preload_file
from inference_service.frontend.tenants import read_tenants_file
from inference_service.limits import RequestLimits
from inference_service.models.quantized import WEIGHTS_DTYPES

log = logging.getLogger("loraplex.cli")
ENV_PREFIX = "LORAPLEX_"


def _env_name(flag: str) -> str:
    return env_name(ENV_PREFIX, flag)


def _add(parser: argparse.ArgumentParser | Any, flag: str, help: str, **kw: Any) -> None:
    add_env_flag(parser, ENV_PREFIX, flag, help, **kw)


def _max_loras(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a count, got {value!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return count


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loraplex-inference",
        description="Serve one base LLM with many LoRA adapters over gRPC (loraplex.v1.Inference).",
        epilog="Every flag can also be set through the environment variable shown with it.",
    )
    g = p.add_argument_group("model and engine")
    _add(g, "--model", "HF checkpoint directory, .gguf file (or a directory holding one), Hugging Face model id "
         "(org/name, from the Hugging Face cache; HF_HOME), or builtin:tiny (a small random LLaMA)",
         default="builtin:tiny")
    _add(g, "--revision", "branch, tag or commit of a Hugging Face model id (default: main)")
    _add(g, "--device", "auto | cpu | cuda | cuda:N", default="auto")
    _add(g, "--dtype", "auto | float32 | float16 | bfloat16; auto: the checkpoint's torch_dtype on an "
         "accelerator, on CPU bfloat16 where the CPU has native bf16 (AVX512-BF16/AMX) or the AVX2 kernel "
         "runs (AVX2 without AVX-512), else float32",
         default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    _add(g, "--weights-dtype", "auto | bf16 | q8_0 | q4_0: how a GGUF file's projection weights are served on "
         "CPU; auto keeps Q8_0 and Q4_0 tensors as they are (read as blocks by their kernel, never dequantized as "
         "a whole), q8_0 / q4_0 serve every projection in that type (quantizing other types at load), bf16 "
         "dequantizes every weight to --dtype",
         default=EngineConfig.weights_dtype, choices=WEIGHTS_DTYPES)
    _add(g, "--max-model-len", "longest prompt + output in tokens (default: the model's context)", type=int)
    _add(g, "--max-loras", "the adapter pool: auto sizes it by memory (--lora-memory-bytes), an adapter taking "
         "memory in proportion to its rank; N: N fixed slots of --max-lora-rank", type=_max_loras,
         default=EngineConfig.max_loras)
    _add(g, "--max-lora-rank", "largest adapter rank accepted", type=int, default=EngineConfig.max_lora_rank)
    _add(g, "--lora-memory-bytes", "device bytes of the adapter pool with --max-loras auto (default: "
         "--lora-memory-fraction of the memory budget, taken before the KV cache)", type=int)
    _add(g, "--lora-memory-fraction", "share of the memory budget for the adapter pool with --max-loras auto "
         "(default: 0.25 on CUDA, 0.5 on CPU)", type=float)
    _add(g, "--lora-page-rank", "rank rows per page of the adapter pool (an adapter of rank r takes "
         "ceil(r / this) pages)", type=int, default=EngineConfig.lora_page_rank)
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
    _add(g, "--grammar-compile-cpu-s", "structured output: CPU seconds a new constraint may take to compile "
         "before it is refused (INVALID_ARGUMENT; wall time at most 6x this, and 30 s at least)", type=float,
         default=ServerConfig.grammar_compile_cpu_s)
    _add(g, "--engine-core", "process: the scheduler in a process of its own, so the front ends' per-message "
         "work never slows a step (docs/architecture.md); thread: in this process (debugging, comparisons)",
         default="process", choices=("process", "thread"))
    _add(g, "--async-scheduling", "on: each step runs on a device thread while the scheduler plans the next one "
         "(the scheduler's CPU time hides behind the accelerator's); auto: on for accelerators, off on CPU",
         default=EngineConfig.async_scheduling, choices=("auto", "on", "off"))
    _add(g, "--prefix-cache", "on: full KV blocks stay cached, keyed by their tokens, the weights (an adapter's "
         "loaded version, never its name) and the operator's salt, and prompts reuse the longest cached prefix",
         default="on" if EngineConfig.prefix_cache else "off", choices=("on", "off"))
    _add(g, "--prefix-cache-scope", "who may share prefix-cached KV: shared (one namespace per weights, all clients), "
         "listener (gRPC and HTTP never share), identity (clients of different tenants never share, on both "
         "front ends: --tenants-file token, --trusted-tenant-header or mTLS subject; anonymous requests share their "
         "listener's namespace)",
         default=ServerConfig.prefix_cache_scope, choices=SCOPES)
    _add(g, "--prefix-cache-salt", "the operator's salt, mixed into every prefix-cache key (e.g. per deployment)")
    _add(g, "--fair-share", "on: admission follows each tenant's served tokens (the Virtual Token Counter, weighted "
         "by the tenants file's weight) and a tenant holding more than its share of a full batch is preempted for "
         "another's waiting request; off: first come, first served (by priority)",
         default="on" if EngineConfig.fair_share else "off", choices=("on", "off"))
    _add(g, "--fair-share-decode-weight", "fair share: what a generated token costs, in prompt tokens", type=float,
         default=EngineConfig.fair_share_decode_weight)
    _add(g, "--stream-interval", "tokens per streamed message after a request's first token (its end is sent at "
         "once); 1 sends every token as it comes. Larger values cut the messages, and the front end's CPU, at "
         "hundreds of concurrent streams", type=int, default=EngineConfig.stream_interval)
    _add(g, "--tokenizer", "auto: the checkpoint's tokenizer.json (required); byte: UTF-8 bytes as token ids",
         default=EngineConfig.tokenizer, choices=("auto", "byte"))

    g = p.add_argument_group("request limits (INVALID_ARGUMENT past them; reported by GetModelInfo)")
    _add(g, "--max-stop-strings", "stop strings per request", type=int, default=RequestLimits.max_stop_strings)
    _add(g, "--max-stop-string-length", "characters per stop string", type=int,
         default=RequestLimits.max_stop_string_length)
    _add(g, "--max-stop-token-ids", "stop token ids per request", type=int, default=RequestLimits.max_stop_token_ids)
    _add(g, "--max-prompt-chars", "characters of a text prompt, checked before tokenization", type=int,
         default=RequestLimits.max_prompt_chars)
    _add(g, "--max-request-id-length", "characters of a request id (printable ASCII)", type=int,
         default=RequestLimits.max_request_id_length)
    _add(g, "--max-n", "samples per request (OpenAI's n, GenerateRequest.n): each is an engine request of its own "
         "(counted against --max-queue) sharing the prompt's prefill", type=int, default=RequestLimits.max_n)

    g = p.add_argument_group("adapters")
    _add(g, "--cache-address",
         "adapter-cache sidecar address (unix:///path or host:port); unset: read file:// URIs directly")
    _add(g, "--cache-token-file", "file holding the bearer token the sidecar requires (its --token-file)")
    _add(g, "--preload-file", "YAML or JSON list of {name, uri, pinned, required, sha256} adapters to keep "
         "loaded: failures retry in the background; required ones gate readiness")
    _add(g, "--preload-reload-s", "re-read --preload-file this often, applying changes (0: read once)",
         type=float, default=ServerConfig.preload_reload_s)
    _add(g, "--host-cache-bytes", "validated adapters from local directories kept in host memory, so one "
         "evicted from its slot is copied back without being read again (0: off)", type=int,
         default=EngineConfig.host_cache_bytes)
    _add(g, "--max-registered-adapters", "adapter names held at most (past it, idle --adapter-resolver "
         "adapters make room, least recently used first; docs/adapters.md)", type=int,
         default=EngineConfig.max_registered_adapters)
    _add(g, "--host-load-workers", "adapter preparations (fetch + validation) running at once", type=int,
         default=EngineConfig.host_load_workers)
    _add(g, "--adapter-load-timeout-s", "deadline of one adapter's preparation; past it the load fails "
         "(UNAVAILABLE) and its worker is freed for others", type=float, default=EngineConfig.adapter_load_timeout_s)
    _add(g, "--adapter-source-allow",
         "allowed adapter URI prefix, e.g. s3://bucket/adapters/ or file:///srv/adapters (repeatable; "
         "none: every adapter URI is PERMISSION_DENIED)", action="append", default=[])
    _add(g, "--adapter-resolver", "URI template, e.g. 's3://bucket/adapters/{name}': a request naming an "
         "unregistered adapter loads it from there first (checked by --adapter-source-allow; off when empty)",
         default=ServerConfig.adapter_resolver)

    g = p.add_argument_group("serving")
    _add(g, "--listen", "HOST:PORT or unix:///path", default=ServerConfig.listen)
    _add(g, "--health-listen", "HOST:PORT serving grpc.health.v1 alone in plaintext, for the kubelet's gRPC "
         "probe when --listen has TLS (empty: off)", default=ServerConfig.health_listen)
    _add(g, "--metrics-port", "Prometheus /metrics port (0: off)", type=int, default=0)
    _add(g, "--metrics-addr", "address the /metrics endpoint binds", default=ServerConfig.metrics_addr)
    _add(g, "--adapter-metrics-top-k",
         "adapters with their own label in loraplex_adapter_requests_total (the rest: adapter=\"other\")",
         type=int, default=ServerConfig.adapter_metrics_top_k)
    _add(g, "--max-message-bytes", "largest gRPC message accepted or sent", type=int,
         default=ServerConfig.max_message_bytes)
    _add(g, "--log-level", "DEBUG | INFO | WARNING | ERROR", default="INFO")

    g = p.add_argument_group("health and shutdown")
    _add(g, "--watchdog-stall-s", "a scheduler step unfinished this long turns health NOT_SERVING, the "
         "'liveness' service included (0: no stall check; a dead engine turns it NOT_SERVING regardless)", type=float,
         default=ServerConfig.watchdog_stall_s)
    _add(g, "--shutdown-grace-s", "on SIGTERM, in-flight requests get this long to finish; the rest are "
         "cancelled", type=float, default=ServerConfig.shutdown_grace_s)
    _add(g, "--drain-delay-s", "on SIGTERM, health (gRPC and HTTP /health) turns NOT_SERVING at once and new "
         "requests on both ports are still served this long (part of --shutdown-grace-s) before they are refused",
         type=float,
         default=ServerConfig.drain_delay_s)

    g = p.add_argument_group("OpenAI-compatible HTTP API (docs/http.md)")
    _add(g, "--http-port", "HTTP port of /v1/completions, /v1/chat/completions, /v1/models, /metrics... (0: off)",
         type=int, default=HttpConfig.port)
    _add(g, "--http-addr", "address the HTTP API binds", default=HttpConfig.addr)
    _add(g, "--served-model-name", "name(s) clients give as `model` for the base model (repeatable; default: "
         "the checkpoint directory's name)", action="append", default=[])
    _add(g, "--chat-template", "Jinja chat template file (default: the checkpoint's)")
    _add(g, "--http-header-timeout-s", "a request's line and headers must arrive within this, counted from the "
         "connection's opening or the request's first byte; slower or silent connections are closed", type=float,
         default=HttpConfig.header_timeout_s)
    _add(g, "--http-body-timeout-s", "a request's body must arrive within this after its headers; a slower "
         "connection is closed (bodies are at most --max-message-bytes)", type=float,
         default=HttpConfig.body_timeout_s)
    _add(g, "--http-max-connections", "open HTTP connections; more are closed as they are accepted (keep it "
         "under the open-files limit)", type=int, default=HttpConfig.max_connections)

    g = p.add_argument_group("security")
    _add(g, "--admin-token-file",
         "file holding the bearer token LoadAdapter/UnloadAdapter require (or set LORAPLEX_ADMIN_TOKEN); "
         "without one, admin RPCs are PERMISSION_DENIED on a non-loopback --listen (open on loopback)")
    _add(g, "--insecure-admin",
         "admin RPCs without a token on a non-loopback address too", action="store_true")
    _add(g, "--tls-cert", "server certificate (PEM); enables TLS")
    _add(g, "--tls-key", "server private key (PEM)")
    _add(g, "--tls-client-ca", "CA (PEM) client certificates must chain to; enables mTLS")

    g = p.add_argument_group("tenants (docs/architecture.md, Tenants)")
    _add(g, "--tenants-file", "JSON or YAML {tenants: [{name, token_sha256 | token_file, admin, max_running, "
         "max_queued, tokens_per_minute, weight, mtls_common_name}]}: bearer tokens (gRPC metadata or HTTP "
         "Authorization) name tenants, and any other token is UNAUTHENTICATED (HTTP 401)")
    _add(g, "--trusted-tenant-header", "header (gRPC metadata key) a gateway in front sets to name the tenant; "
         "honoured only when set (empty: requests' headers never name a tenant)")
    _add(g, "--tenant-metrics-top-k", "tenants with their own label in the loraplex_tenant_* series (the rest: "
         "tenant=\"other\")", type=int, default=ServerConfig.tenant_metrics_top_k)
    return p


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """EngineConfig and ServerConfig from parsed flags; raises ValueError on an unsafe setup."""
    token = os.environ.get("LORAPLEX_ADMIN_TOKEN") or None
    if args.admin_token_file:
        token = read_token_file(args.admin_token_file)
    if args.cache_token_file:
        read_tokens(args.cache_token_file)  # unreadable or empty: a usage error now, not at the first load
    allow = tuple(args.adapter_source_allow)
    UriPolicy(allow)  # reject malformed prefixes at startup
    if args.adapter_resolver:
        check_template(args.adapter_resolver)
        if not allow:
            raise ValueError("--adapter-resolver needs --adapter-source-allow covering its URIs")
    if args.shutdown_grace_s < 0 or args.drain_delay_s < 0 or args.watchdog_stall_s < 0:
        raise ValueError("--shutdown-grace-s, --drain-delay-s and --watchdog-stall-s must be >= 0")
    if args.stream_interval < 1:
        raise ValueError("--stream-interval must be >= 1")
    if args.max_n < 1:
        raise ValueError("--max-n must be >= 1")
    if args.max_loras != "auto" and args.lora_memory_bytes is not None:
        raise ValueError("--lora-memory-bytes sizes the pool of --max-loras auto; "
                         f"--max-loras {args.max_loras} is a fixed count of slots: give one or the other")
    tenants = read_tenants_file(args.tenants_file) if args.tenants_file else ()
    header = (args.trusted_tenant_header or "").strip() or None
    if header is not None and (not header.isascii() or not header.replace("-", "").isalnum()
                               or header.lower() in ("authorization", "host", "content-type")):
        raise ValueError(f"--trusted-tenant-header {header!r} is not a header name this server can trust")
    if args.tenant_metrics_top_k < 0:
        raise ValueError("--tenant-metrics-top-k must be >= 0")
    reason = admin_disabled_reason(args.listen, token, args.insecure_admin)
    if reason:
        log.warning("%s", reason)
    engine_cfg = EngineConfig(
        model=args.model,
        revision=args.revision,
        device=args.device,
        dtype=args.dtype,
        weights_dtype=args.weights_dtype,
        max_model_len=args.max_model_len,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        lora_memory_bytes=args.lora_memory_bytes,
        lora_memory_fraction=args.lora_memory_fraction,
        lora_page_rank=args.lora_page_rank,
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_queue=args.max_queue,
        max_new_tokens_limit=args.max_new_tokens_limit,
        adapter_source_allow=allow,
        cache_address=args.cache_address,
        cache_token_file=args.cache_token_file,
        host_cache_bytes=args.host_cache_bytes,
        seed=args.seed,
        max_registered_adapters=args.max_registered_adapters,
        host_load_workers=args.host_load_workers,
        adapter_load_timeout_s=args.adapter_load_timeout_s,
        limits=RequestLimits(
            max_stop_strings=args.max_stop_strings,
            max_stop_string_length=args.max_stop_string_length,
            max_stop_token_ids=args.max_stop_token_ids,
            max_prompt_chars=args.max_prompt_chars,
            max_request_id_length=args.max_request_id_length,
            max_n=args.max_n,
        ),
        tokenizer=args.tokenizer,
        async_scheduling=args.async_scheduling,
        prefix_cache=args.prefix_cache == "on",
        fair_share=args.fair_share == "on",
        fair_share_decode_weight=args.fair_share_decode_weight,
        stream_interval=args.stream_interval,
    )
    server_cfg = ServerConfig(
        prefix_cache_scope=args.prefix_cache_scope,
        prefix_cache_salt=args.prefix_cache_salt,
        listen=args.listen,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        admin_token=token,
        health_listen=args.health_listen,
        insecure_admin=args.insecure_admin,
        adapter_source_allow=allow,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        max_message_bytes=args.max_message_bytes,
        default_max_new_tokens=args.default_max_new_tokens,
        grammar_compile_cpu_s=args.grammar_compile_cpu_s,
        adapter_metrics_top_k=args.adapter_metrics_top_k,
        adapter_resolver=args.adapter_resolver,
        preload=read_preload_file(args.preload_file) if args.preload_file else [],
        preload_file=args.preload_file,
        preload_reload_s=args.preload_reload_s,
        shutdown_grace_s=args.shutdown_grace_s,
        drain_delay_s=args.drain_delay_s,
        watchdog_stall_s=args.watchdog_stall_s,
        tenants=tenants,
        trusted_tenant_header=header,
        tenant_metrics_top_k=args.tenant_metrics_top_k,
    )
    return engine_cfg, server_cfg


def http_config_from_args(args: argparse.Namespace) -> HttpConfig:
    """The HTTP front end's settings; its admin routes follow the gRPC rules (admin_disabled_reason)."""
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError("--max-model-len must be >= 2")
    if args.chat_template and not os.path.isfile(args.chat_template):
        raise ValueError(f"--chat-template {args.chat_template}: no such file")
    if args.http_header_timeout_s <= 0 or args.http_body_timeout_s <= 0 or args.http_max_connections < 1:
        raise ValueError("--http-header-timeout-s and --http-body-timeout-s must be > 0, "
                         "--http-max-connections >= 1")
    return HttpConfig(port=args.http_port, addr=args.http_addr,
                      served_model_names=tuple(args.served_model_name), chat_template=args.chat_template,
                      header_timeout_s=args.http_header_timeout_s, body_timeout_s=args.http_body_timeout_s,
                      max_connections=args.http_max_connections)


async def _serve_until_signal(engine: EngineClient, server_cfg: ServerConfig, sink: Any, http_cfg: HttpConfig,
                              registry: Any) -> None:
    from inference_service.frontend.grpc_server import serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    front_ends = []
    if http_cfg.port:
        from inference_service.frontend.chat_template import load_chat_template
        from inference_service.frontend.http.app import build_app
        from inference_service.frontend.http.serving import HttpFrontEnd

        names = http_cfg.served_model_names or (engine.model_info.name,)
        template = load_chat_template(engine.config.model, http_cfg.chat_template, engine.config.revision)
        app = build_app(engine, server_cfg, names, template, registry, f"{http_cfg.addr}:{http_cfg.port}")
        front_ends.append(HttpFrontEnd(app, http_cfg))  # drains beside gRPC: same readiness, delay and grace
    await serve(engine, server_cfg, sink, stop=stop, collectors=registry, front_ends=front_ends)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        engine_cfg, server_cfg = configs_from_args(args)
        http_cfg = http_config_from_args(args)
    except (ValueError, OSError, LoraplexError) as e:
        parser.error(str(e))

    from inference_service.engine.heap import freeze_startup_objects
    from inference_service.engine.in_process import Engine
    from inference_service.engine.process import ProcessEngine
    from inference_service.frontend.metrics import EngineCollector, build_registry, serve_metrics
    from inference_service.frontend.residency import ResidencyCollector

    registry, sink = build_registry(server_cfg.adapter_metrics_top_k)
    # The core process is forked here, before any server thread exists and before this process
    # has touched CUDA or torch's thread pool (a child forked after either cannot use them). With
    # this, torch answers cuda.is_available() from NVML, which leaves CUDA uninitialized.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if args.engine_core == "process":
        engine: Engine | ProcessEngine = ProcessEngine(engine_cfg, metrics=sink, start_method="fork")
    else:
        engine = Engine(engine_cfg, metrics=sink)
    registry.register(EngineCollector(engine.stats))
    registry.register(ResidencyCollector(engine, server_cfg.adapter_metrics_top_k))
    registry.register(server_cfg.tenancy.collector())
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
