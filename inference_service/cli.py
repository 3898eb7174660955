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
from pathlib import Path
from typing import Any, NoReturn

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
from inference_service.frontend.preload import PreloadEntry, read_preload_file
from inference_service.frontend.tenants import read_tenants_file
from inference_service.frontend.tool_parsers import PARSERS
from inference_service.limits import RequestLimits
from inference_service.models.quantized import WEIGHTS_DTYPES
from inference_service.platform.platform import ATTENTION_BACKENDS, DECODE_STACK, KERNELS

log = logging.getLogger("loraplex.cli")
ENV_PREFIX = "LORAPLEX_"
DEFAULT_HTTP_PORT = 8000  # vLLM's


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


def _lora_module(value: str) -> tuple[str, str]:
    """vLLM's `--lora-modules name=path`."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {value!r}")
    return name, path


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
    p = _Parser(
        prog="loraplex-inference",
        description="Serve one base LLM with many LoRA adapters over gRPC (loraplex.v1.Inference).",
        epilog="Every flag can also be set through the environment variable shown with it.",
    )
    g = p.add_argument_group("model and engine")
    _add(g, "--model", "required: HF checkpoint directory, .gguf file (or a directory holding one), Hugging Face "
         "model id (org/name, from the Hugging Face cache; HF_HOME), or builtin:tiny (a small random LLaMA for "
         "tests: its output is noise)", required=_env_name("--model") not in os.environ)
    _add(g, "--revision", "branch, tag or commit of a Hugging Face model id (default: main)")
    _add(g, "--device", "auto | cpu | cuda | cuda:N", default="auto")
    _add(g, "--dtype", "auto | float32 | float16 | bfloat16; auto: the checkpoint's torch_dtype on an "
         "accelerator, on CPU bfloat16 where the CPU has native bf16 (AVX512-BF16/AMX) or the AVX2 kernel "
         "runs (AVX2 without AVX-512), else float32",
         default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    _add(g, "--weights-dtype", "auto | bf16 | q8_0 | q4_0: how a GGUF file's projection weights are served on "
         "CPU; auto keeps Q8_0 and Q4_0 tensors as they are in a file mostly of those types (read as blocks by "
         "their kernel, never dequantized as a whole), q8_0 / q4_0 serve every projection in that type "
         "(quantizing other types at load), bf16 "
         "dequantizes every weight to --dtype",
         default=EngineConfig.weights_dtype, choices=WEIGHTS_DTYPES)
    _add(g, "--max-model-len", "longest prompt + output in tokens (default: the model's context)", type=int)
    _add(g, "--max-loras", "the adapter pool: auto sizes it by memory (--lora-memory-bytes), an adapter taking "
         "memory in proportion to its rank; N: N fixed slots of --max-lora-rank", type=_max_loras,
         default=EngineConfig.max_loras)
    _add(g, "--max-lora-rank", "largest adapter rank accepted; auto: with --max-loras auto the largest of 64, 32, 16 "
         "the pool holds 8 adapters of (the pool spends memory by an adapter's real rank), with N slots 16",
         type=_max_loras, default=EngineConfig.max_lora_rank)
    _add(g, "--lora-memory-bytes", "device bytes of the adapter pool with --max-loras auto (default: "
         "--lora-memory-fraction of the memory budget, taken before the KV cache)", type=int)
    _add(g, "--memory-budget-bytes", "bytes of the adapter pool and the KV cache together (default: measured "
         "once the weights are loaded, 0.9 of the free device memory on CUDA, 0.25 of the available host memory "
         "on CPU: MemAvailable, or the cgroup limit less usage); the split is logged at start", type=int)
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
    _add(g, "--max-new-tokens-limit", "largest max_new_tokens (HTTP: max_tokens) a request may ask for "
         "(default: the context)", type=int, default=EngineConfig.max_new_tokens_limit)
    _add(g, "--default-max-new-tokens", "max_new_tokens (HTTP: max_tokens) of requests that leave it unset "
         "(default, or 0: the rest of the context after the prompt, as OpenAI and vLLM)", type=int,
         default=ServerConfig.default_max_new_tokens)
    _add(g, "--seed", "seeds sampling for requests that set no seed of their own", type=int,
         default=EngineConfig.seed)
    _add(g, "--grammar-compile-cpu-s", "structured output: CPU seconds a new constraint may take to compile "
         "before it is refused (INVALID_ARGUMENT; wall time at most 6x this, and 30 s at least)", type=float,
         default=ServerConfig.grammar_compile_cpu_s)
    _add(g, "--grammar-compile-wall-s", "structured output: wall seconds a new constraint's compile may take; one "
         "that reaches it with less CPU time than --grammar-compile-cpu-s was starved: 503 / UNAVAILABLE, not "
         "cached (0: 6x the CPU bound, 30 s at least)", type=float, default=ServerConfig.grammar_compile_wall_s)
    _add(g, "--grammar-check-processes", "structured output: compile processes checking new constraints side by "
         "side (a check waits only while all are busy)", type=int, default=ServerConfig.grammar_check_processes)
    _add(g, "--engine-core", "process: the scheduler in a process of its own, so the front ends' per-message "
         "work never slows a step (docs/architecture.md); thread: in this process (debugging, comparisons)",
         default="process", choices=("process", "thread"))
    _add(g, "--async-scheduling", "on: each step runs on a device thread while the scheduler plans the next one "
         "(the scheduler's CPU time hides behind the accelerator's); auto: on for accelerators, off on CPU",
         default=EngineConfig.async_scheduling, choices=("auto", "on", "off"))
    _add(g, "--kernels", "auto: the C kernels on CPU wherever they load (projections, attention, LoRA, fused ops, "
         "the decode stack); off: every torch path (the same results); the start-up log's platform plan says "
         "what runs", default=EngineConfig.kernels, choices=KERNELS)
    _add(g, "--attention-backend", "auto: the C kernels on CPU, Triton on CUDA where installed, else torch's SDPA; "
         "c | triton | torch name one (refused at start where it cannot run)",
         default=EngineConfig.attention_backend, choices=ATTENTION_BACKENDS)
    _add(g, "--decode-stack", "auto: steps of decodes alone run every layer in one C call where the kernels and "
         "the model family allow (the platform plan says whether and why not); off: the layer forward",
         default=EngineConfig.decode_stack, choices=DECODE_STACK)
    _add(g, "--huge-pages", "on: the packed weights and the adapter pool ask for 2 MiB pages (transparent huge "
         "pages, where the OS allows); off: ordinary pages",
         default="on" if EngineConfig.huge_pages else "off", choices=("on", "off"))
    _add(g, "--prefix-cache", "on: full KV blocks stay cached, keyed by their tokens, the weights (an adapter's "
         "loaded version, never its name) and the operator's salt, and prompts reuse the longest cached prefix",
         default="on" if EngineConfig.prefix_cache else "off", choices=("on", "off"))
    _add(g, "--prefix-cache-scope", "who may share prefix-cached KV: shared (one namespace per weights, all clients), "
         "listener (gRPC and HTTP never share), identity (clients of different tenants never share, on both "
         "front ends, unless the tenants file puts them in one cache_group; anonymous requests keep their "
         "listener's namespace). Default: identity when any tenant configuration is given (--tenants-file, "
         "--trusted-tenant-header, --tls-client-ca), else shared",
         default=None, choices=SCOPES)
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
    _add(g, "--lora-modules", "name=path [name=path ...]: adapters in local directories loaded at start (as "
         "vLLM's flag; readiness waits for them); their directories are added to --adapter-source-allow",
         nargs="+", action="extend", type=_lora_module, default=[])
    _add(g, "--preload-reload-s", "re-read --preload-file this often, applying changes (0: read once)",
         type=float, default=ServerConfig.preload_reload_s)
    _add(g, "--host-cache-bytes", "validated adapters from local directories kept in host memory, so one "
         "evicted from its slot is copied back without being read again (0: off)", type=int,
         default=EngineConfig.host_cache_bytes)
    _add(g, "--grammar-cache-bytes", "structured output: compiled grammars kept for reuse, in bytes (each measured; "
         "least recently used out first)", type=int, default=EngineConfig.grammar_cache_bytes)
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
         type=int, default=DEFAULT_HTTP_PORT)
    _add(g, "--http-addr", "address the HTTP API binds", default=HttpConfig.addr)
    _add(g, "--served-model-name", "name(s) clients give as `model` for the base model (repeatable; default: "
         "the checkpoint directory's name)", action="append", default=[])
    _add(g, "--chat-template", "Jinja chat template file (default: the checkpoint's)")
    _add(g, "--tool-call-parser", "how tool_choice 'auto' finds tool calls in the model's text: hermes "
         "(<tool_call>{json}</tool_call>), llama3_json ({\"name\", \"parameters\"}), or auto: the one the chat "
         "template writes (docs/http.md)", choices=PARSERS, default=HttpConfig.tool_call_parser)
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
         "max_queued, tokens_per_minute, weight, mtls_common_name, min_priority, via_trusted_header, cache_group, "
         "sources, max_adapters, adapter_pool_bytes}]} "
         "(docs/tenants.md): bearer tokens (gRPC metadata or HTTP Authorization) name tenants. With any tenant "
         "configuration (this file, --trusted-tenant-header, --tls-client-ca) a request without a valid credential "
         "is UNAUTHENTICATED (HTTP 401), unless an entry {name: anonymous, anonymous: true, <limits>} declares "
         "the anonymous tenant")
    _add(g, "--trusted-tenant-header", "header (gRPC metadata key) a gateway in front sets to name the tenant; "
         "honoured only when set, and only for tenants whose entry says via_trusted_header: true (a bearer token, "
         "when present, decides instead). The port must then be reachable only through that gateway")
    _add(g, "--tenant-metrics-top-k", "tenants with their own label in the loraplex_tenant_* series (the rest: "
         "tenant=\"other\")", type=int, default=ServerConfig.tenant_metrics_top_k)
    _add(g, "--state-dir", "directory for state that outlives the process: the adapters loaded through the API, "
         "with their tenants, registered again at start (mount a volume here; docs/tenants.md)")
    return p


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """EngineConfig and ServerConfig from parsed flags; raises ValueError on an unsafe setup."""
    token = os.environ.get("LORAPLEX_ADMIN_TOKEN") or None
    if args.admin_token_file:
        token = read_token_file(args.admin_token_file)
    if args.cache_token_file:
        read_tokens(args.cache_token_file)  # unreadable or empty: a usage error now, not at the first load
    modules = lora_module_entries(args.lora_modules)
    allow = tuple(args.adapter_source_allow) + tuple(e.uri for e in modules if e.uri not in args.adapter_source_allow)
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
    preload = read_preload_file(args.preload_file) if args.preload_file else []
    twice = sorted({e.name for e in preload} & {e.name for e in modules})
    if twice:
        raise ValueError(f"adapter {twice[0]!r} is in both --lora-modules and --preload-file")
    tenants = read_tenants_file(args.tenants_file) if args.tenants_file else ()
    header = (args.trusted_tenant_header or "").strip() or None
    if header is not None and (not header.isascii() or not header.replace("-", "").isalnum()
                               or header.lower() in ("authorization", "host", "content-type")):
        raise ValueError(f"--trusted-tenant-header {header!r} is not a header name this server can trust")
    if header is not None and not any(t.via_trusted_header for t in tenants):
        raise ValueError(f"--trusted-tenant-header {header}: no tenant of --tenants-file accepts it "
                         "(via_trusted_header: true)")
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
        memory_budget_bytes=args.memory_budget_bytes,
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
        grammar_cache_bytes=args.grammar_cache_bytes,
        seed=args.seed,
        max_registered_adapters=args.max_registered_adapters,
        adapter_pool_shares={t.name: t.adapter_pool_bytes for t in tenants if t.adapter_pool_bytes is not None},
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
        kernels=args.kernels,
        attention_backend=args.attention_backend,
        decode_stack=args.decode_stack,
        huge_pages=args.huge_pages == "on",
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
        default_max_new_tokens=args.default_max_new_tokens or None,  # 0: the rest of the context
        grammar_compile_cpu_s=args.grammar_compile_cpu_s,
        grammar_compile_wall_s=args.grammar_compile_wall_s,
        grammar_check_processes=args.grammar_check_processes,
        adapter_metrics_top_k=args.adapter_metrics_top_k,
        adapter_resolver=args.adapter_resolver,
        preload=preload,
        lora_modules=modules,
        preload_file=args.preload_file,
        preload_reload_s=args.preload_reload_s,
        shutdown_grace_s=args.shutdown_grace_s,
        drain_delay_s=args.drain_delay_s,
        watchdog_stall_s=args.watchdog_stall_s,
        tenants=tenants,
        trusted_tenant_header=header,
        tenant_metrics_top_k=args.tenant_metrics_top_k,
        state_dir=args.state_dir,
    )
    log.info("prefix cache scope: %s (%s)", server_cfg.cache_scope,
             "--prefix-cache-scope" if args.prefix_cache_scope else
             "tenants configured: per tenant" if server_cfg.tenancy.enabled else "no tenants configured")
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
                      max_connections=args.http_max_connections, tool_call_parser=args.tool_call_parser)


async def _serve_until_signal(engine: EngineClient, server_cfg: ServerConfig, sink: Any, http_cfg: HttpConfig,
                              registry: Any) -> None:
    from inference_service.frontend.grpc_server import serve

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
