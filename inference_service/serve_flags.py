"""Every flag of `loraplex-inference`, declared once (inference_service/flags.py makes the parser,
--help and the environment mirrors LORAPLEX_<FLAG> from these fields).

A flag declared `into=` a config class is that field's value as it is; the others are read by
cli.configs_from_args and cli.http_config_from_args, which check them and build what they name.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from inference_service.engine.config import EngineConfig
from inference_service.flags import flag
from inference_service.frontend.cache_salt import SCOPES
from inference_service.frontend.config import ServerConfig
from inference_service.frontend.http.config import HttpConfig
from inference_service.frontend.tool_parsers import PARSERS
from inference_service.limits import RequestLimits
from inference_service.models.quantized import WEIGHTS_DTYPES
from inference_service.platform.platform import ATTENTION_BACKENDS, DECODE_STACK, KERNELS

DEFAULT_HTTP_PORT = 8000  # vLLM's

# The --help sections, in their order.
ENGINE = "model and engine"
LIMITS = "request limits (INVALID_ARGUMENT past them; reported by GetModelInfo)"
ADAPTERS = "adapters"
SERVING = "serving"
HEALTH = "health and shutdown"
HTTP = "OpenAI-compatible HTTP API (docs/http.md)"
SECURITY = "security"
TENANTS = "tenants (docs/tenants.md)"


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


@dataclass(frozen=True, kw_only=True)
class ServeFlags:
    """The server's flags, parsed (flags.from_namespace); the field order is --help's."""
    model: str = flag(ENGINE,
        "required: HF checkpoint directory, .gguf file (or a directory holding one), Hugging Face model id (org/name, "
        "from the Hugging Face cache; HF_HOME), or builtin:tiny (a small random LLaMA for tests: its output is noise)",
        required=True, into=EngineConfig)
    revision: str | None = flag(ENGINE, "branch, tag or commit of a Hugging Face model id (default: main)",
        into=EngineConfig)
    device: str = flag(ENGINE, "auto | cpu | cuda | cuda:N", default="auto", into=EngineConfig)
    dtype: str = flag(ENGINE,
        "auto | float32 | float16 | bfloat16; auto: the checkpoint's torch_dtype on an accelerator, on CPU bfloat16 "
        "where the CPU has native bf16 (AVX512-BF16/AMX) or the AVX2 kernel runs (AVX2 without AVX-512), else float32",
        default="auto", choices=("auto", "float32", "float16", "bfloat16"), into=EngineConfig)
    weights_dtype: str = flag(ENGINE,
        "auto | bf16 | q8_0 | q4_0: how a GGUF file's projection weights are served on CPU; auto keeps Q8_0 and Q4_0 "
        "tensors as they are in a file mostly of those types (read as blocks by their kernel, never dequantized as a "
        "whole), q8_0 / q4_0 serve every projection in that type (quantizing other types at load), bf16 dequantizes "
        "every weight to --dtype",
        default=EngineConfig.weights_dtype, choices=WEIGHTS_DTYPES, into=EngineConfig)
    max_model_len: int | None = flag(ENGINE, "longest prompt + output in tokens (default: the model's context)",
        into=EngineConfig)
    max_loras: int | str = flag(ENGINE,
        "the adapter pool: auto sizes it by memory (--lora-memory-bytes), an adapter taking memory in proportion to its"
        " rank; N: N fixed slots of --max-lora-rank",
        parse=_max_loras, default=EngineConfig.max_loras, into=EngineConfig)
    max_lora_rank: int | str = flag(ENGINE,
        "largest adapter rank accepted; auto: with --max-loras auto the largest of 64, 32, 16 the pool holds 8 adapters"
        " of (the pool spends memory by an adapter's real rank), with N slots 16",
        parse=_max_loras, default=EngineConfig.max_lora_rank, into=EngineConfig)
    lora_memory_bytes: int | None = flag(ENGINE,
        "device bytes of the adapter pool with --max-loras auto (default: --lora-memory-fraction of the memory budget, "
        "taken before the KV cache)",
        into=EngineConfig)
    memory_budget_bytes: int | None = flag(ENGINE,
        "bytes of the adapter pool and the KV cache together (default: measured once the weights are loaded, 0.9 of the"
        " free device memory on CUDA, 0.25 of the available host memory on CPU: MemAvailable, or the cgroup limit less "
        "usage); the split is logged at start",
        into=EngineConfig)
    lora_memory_fraction: float | None = flag(ENGINE,
        "share of the memory budget for the adapter pool with --max-loras auto (default: 0.25 on CUDA, 0.5 on CPU)",
        into=EngineConfig)
    lora_page_rank: int = flag(ENGINE,
        "rank rows per page of the adapter pool (an adapter of rank r takes ceil(r / this) pages)",
        default=EngineConfig.lora_page_rank, into=EngineConfig)
    kv_cache_bytes: int | None = flag(ENGINE, "KV cache size in bytes (default: what the memory budget leaves)",
        into=EngineConfig)
    max_num_seqs: int = flag(ENGINE, "running requests per scheduler step",
        default=EngineConfig.max_num_seqs, into=EngineConfig)
    max_num_batched_tokens: int = flag(ENGINE, "token budget per scheduler step",
        default=EngineConfig.max_num_batched_tokens, into=EngineConfig)
    max_queue: int = flag(ENGINE, "waiting requests before RESOURCE_EXHAUSTED",
        default=EngineConfig.max_queue, into=EngineConfig)
    max_new_tokens_limit: int | None = flag(ENGINE,
        "largest max_new_tokens (HTTP: max_tokens) a request may ask for (default: the context)",
        default=EngineConfig.max_new_tokens_limit, into=EngineConfig)
    default_max_new_tokens: int | None = flag(ENGINE,
        "max_new_tokens (HTTP: max_tokens) of requests that leave it unset (default, or 0: the rest of the context "
        "after the prompt, as OpenAI and vLLM)",
        default=ServerConfig.default_max_new_tokens)
    seed: int = flag(ENGINE, "seeds sampling for requests that set no seed of their own",
        default=EngineConfig.seed, into=EngineConfig)
    grammar_compile_cpu_s: float = flag(ENGINE,
        "structured output: CPU seconds a new constraint may take to compile before it is refused (INVALID_ARGUMENT; "
        "wall time at most 6x this, and 30 s at least)",
        default=ServerConfig.grammar_compile_cpu_s, into=ServerConfig)
    grammar_compile_wall_s: float = flag(ENGINE,
        "structured output: wall seconds a new constraint's compile may take; one that reaches it with less CPU time "
        "than --grammar-compile-cpu-s was starved: 503 / UNAVAILABLE, not cached (0: 6x the CPU bound, 30 s at least)",
        default=ServerConfig.grammar_compile_wall_s, into=ServerConfig)
    grammar_check_processes: int = flag(ENGINE,
        "structured output: compile processes checking new constraints side by side (a check waits only while all are "
        "busy)",
        default=ServerConfig.grammar_check_processes, into=ServerConfig)
    engine_core: str = flag(ENGINE,
        "process: the scheduler in a process of its own, so the front ends' per-message work never slows a step "
        "(docs/architecture.md); thread: in this process (debugging, comparisons)",
        default="process", choices=("process", "thread"))
    async_scheduling: str = flag(ENGINE,
        "on: each step runs on a device thread while the scheduler plans the next one (the scheduler's CPU time hides "
        "behind the accelerator's); auto: on for accelerators, off on CPU",
        default=EngineConfig.async_scheduling, choices=("auto", "on", "off"), into=EngineConfig)
    kernels: str = flag(ENGINE,
        "auto: the C kernels on CPU wherever they load (projections, attention, LoRA, fused ops, the decode stack); "
        "off: every torch path (the same results); the start-up log's platform plan says what runs",
        default=EngineConfig.kernels, choices=KERNELS, into=EngineConfig)
    attention_backend: str = flag(ENGINE,
        "auto: the C kernels on CPU, Triton on CUDA where installed, else torch's SDPA; c | triton | torch name one "
        "(refused at start where it cannot run)",
        default=EngineConfig.attention_backend, choices=ATTENTION_BACKENDS, into=EngineConfig)
    decode_stack: str = flag(ENGINE,
        "auto: steps of decodes alone run every layer in one C call where the kernels and the model family allow "
        "(the platform plan says whether and why not); off: the layer forward",
        default=EngineConfig.decode_stack, choices=DECODE_STACK, into=EngineConfig)
    huge_pages: str = flag(ENGINE,
        "on: the packed weights and the adapter pool ask for 2 MiB pages (transparent huge pages, where the OS "
        "allows); off: ordinary pages",
        default="on" if EngineConfig.huge_pages else "off", choices=("on", "off"))
    prefix_cache: str = flag(ENGINE,
        "on: full KV blocks stay cached, keyed by their tokens, the weights (an adapter's loaded version, never its "
        "name) and the operator's salt, and prompts reuse the longest cached prefix",
        default="on" if EngineConfig.prefix_cache else "off", choices=("on", "off"))
    prefix_cache_scope: str | None = flag(ENGINE,
        "who may share prefix-cached KV: shared (one namespace per weights, all clients), listener (gRPC and HTTP never"
        " share), identity (clients of different tenants never share, on both front ends, unless the tenants file puts "
        "them in one cache_group; anonymous requests keep their listener's namespace). Default: identity when any "
        "tenant configuration is given (--tenants-file, --trusted-tenant-header, --tls-client-ca), else shared",
        default=None, choices=SCOPES, into=ServerConfig)
    prefix_cache_salt: str | None = flag(ENGINE,
        "the operator's salt, mixed into every prefix-cache key (e.g. per deployment)",
        into=ServerConfig)
    fair_share: str = flag(ENGINE,
        "on: admission follows each tenant's served tokens (the Virtual Token Counter, weighted by the tenants file's "
        "weight) and a tenant holding more than its share of a full batch is preempted for another's waiting request; "
        "off: first come, first served (by priority)",
        default="on" if EngineConfig.fair_share else "off", choices=("on", "off"))
    fair_share_decode_weight: float = flag(ENGINE, "fair share: what a generated token costs, in prompt tokens",
        default=EngineConfig.fair_share_decode_weight, into=EngineConfig)
    stream_interval: int = flag(ENGINE,
        "tokens per streamed message after a request's first token (its end is sent at once); 1 sends every token as it"
        " comes. Larger values cut the messages, and the front end's CPU, at hundreds of concurrent streams",
        default=EngineConfig.stream_interval, into=EngineConfig)
    tokenizer: str = flag(ENGINE, "auto: the checkpoint's tokenizer.json (required); byte: UTF-8 bytes as token ids",
        default=EngineConfig.tokenizer, choices=("auto", "byte"), into=EngineConfig)

    max_stop_strings: int = flag(LIMITS, "stop strings per request",
        default=RequestLimits.max_stop_strings, into=RequestLimits)
    max_stop_string_length: int = flag(LIMITS, "characters per stop string",
        default=RequestLimits.max_stop_string_length, into=RequestLimits)
    max_stop_token_ids: int = flag(LIMITS, "stop token ids per request",
        default=RequestLimits.max_stop_token_ids, into=RequestLimits)
    max_prompt_chars: int = flag(LIMITS, "characters of a text prompt, checked before tokenization",
        default=RequestLimits.max_prompt_chars, into=RequestLimits)
    max_request_id_length: int = flag(LIMITS, "characters of a request id (printable ASCII)",
        default=RequestLimits.max_request_id_length, into=RequestLimits)
    max_n: int = flag(LIMITS,
        "samples per request (OpenAI's n, GenerateRequest.n): each is an engine request of its own (counted against "
        "--max-queue) sharing the prompt's prefill",
        default=RequestLimits.max_n, into=RequestLimits)

    cache_address: str | None = flag(ADAPTERS,
        "adapter-cache sidecar address (unix:///path or host:port); unset: read file:// URIs directly",
        into=EngineConfig)
    cache_token_file: str | None = flag(ADAPTERS,
        "file holding the bearer token the sidecar requires (its --token-file)",
        into=EngineConfig)
    preload_file: str | None = flag(ADAPTERS,
        "YAML or JSON list of {name, uri, pinned, required, sha256} adapters to keep loaded: failures retry in the "
        "background; required ones gate readiness",
        into=ServerConfig)
    lora_modules: list[tuple[str, str]] = flag(ADAPTERS,
        "name=path [name=path ...]: adapters in local directories loaded at start (as vLLM's flag; readiness waits for "
        "them); their directories are added to --adapter-source-allow",
        nargs="+", parse=_lora_module, default=[])
    preload_reload_s: float = flag(ADAPTERS, "re-read --preload-file this often, applying changes (0: read once)",
        default=ServerConfig.preload_reload_s, into=ServerConfig)
    host_cache_bytes: int = flag(ADAPTERS,
        "validated adapters from local directories kept in host memory, so one evicted from its slot is copied back "
        "without being read again (0: off)",
        default=EngineConfig.host_cache_bytes, into=EngineConfig)
    grammar_cache_bytes: int = flag(ADAPTERS,
        "structured output: compiled grammars kept for reuse, in bytes (each measured; least recently used out first)",
        default=EngineConfig.grammar_cache_bytes, into=EngineConfig)
    max_registered_adapters: int = flag(ADAPTERS,
        "adapter names held at most (past it, idle --adapter-resolver adapters make room, least recently used first; "
        "docs/adapters.md)",
        default=EngineConfig.max_registered_adapters, into=EngineConfig)
    host_load_workers: int = flag(ADAPTERS, "adapter preparations (fetch + validation) running at once",
        default=EngineConfig.host_load_workers, into=EngineConfig)
    adapter_load_timeout_s: float = flag(ADAPTERS,
        "deadline of one adapter's preparation; past it the load fails (UNAVAILABLE) and its worker is freed for "
        "others",
        default=EngineConfig.adapter_load_timeout_s, into=EngineConfig)
    adapter_source_allow: list[str] = flag(ADAPTERS,
        "allowed adapter URI prefix, e.g. s3://bucket/adapters/ or file:///srv/adapters (repeatable; none: every "
        "adapter URI is PERMISSION_DENIED)",
        default=[])
    adapter_resolver: str = flag(ADAPTERS,
        "URI template, e.g. 's3://bucket/adapters/{name}': a request naming an unregistered adapter loads it from there"
        " first (checked by --adapter-source-allow; off when empty)",
        default=ServerConfig.adapter_resolver, into=ServerConfig)

    listen: str = flag(SERVING, "HOST:PORT or unix:///path", default=ServerConfig.listen, into=ServerConfig)
    health_listen: str = flag(SERVING,
        "HOST:PORT serving grpc.health.v1 alone in plaintext, for the kubelet's gRPC probe when --listen has TLS "
        "(empty: off)",
        default=ServerConfig.health_listen, into=ServerConfig)
    metrics_port: int = flag(SERVING, "Prometheus /metrics port (0: off)", default=0, into=ServerConfig)
    metrics_addr: str = flag(SERVING, "address the /metrics endpoint binds",
        default=ServerConfig.metrics_addr, into=ServerConfig)
    adapter_metrics_top_k: int = flag(SERVING,
        "adapters with their own label in loraplex_adapter_requests_total (the rest: adapter=\"other\")",
        default=ServerConfig.adapter_metrics_top_k, into=ServerConfig)
    max_message_bytes: int = flag(SERVING, "largest gRPC message accepted or sent",
        default=ServerConfig.max_message_bytes, into=ServerConfig)
    log_level: str = flag(SERVING, "DEBUG | INFO | WARNING | ERROR", default="INFO")

    watchdog_stall_s: float = flag(HEALTH,
        "a scheduler step unfinished this long turns health NOT_SERVING, the 'liveness' service included (0: no stall "
        "check; a dead engine turns it NOT_SERVING regardless)",
        default=ServerConfig.watchdog_stall_s, into=ServerConfig)
    shutdown_grace_s: float = flag(HEALTH,
        "on SIGTERM, in-flight requests get this long to finish; the rest are cancelled",
        default=ServerConfig.shutdown_grace_s, into=ServerConfig)
    drain_delay_s: float = flag(HEALTH,
        "on SIGTERM, health (gRPC and HTTP /health) turns NOT_SERVING at once and new requests on both ports are still "
        "served this long (part of --shutdown-grace-s) before they are refused",
        default=ServerConfig.drain_delay_s, into=ServerConfig)

    http_port: int = flag(HTTP, "HTTP port of /v1/completions, /v1/chat/completions, /v1/models, /metrics... (0: off)",
        default=DEFAULT_HTTP_PORT, into=HttpConfig, field="port")
    http_addr: str = flag(HTTP, "address the HTTP API binds", default=HttpConfig.addr, into=HttpConfig, field="addr")
    served_model_name: list[str] = flag(HTTP,
        "name(s) clients give as `model` for the base model (repeatable; default: the checkpoint directory's name)",
        default=[])
    chat_template: str | None = flag(HTTP, "Jinja chat template file (default: the checkpoint's)", into=HttpConfig)
    tool_call_parser: str = flag(HTTP,
        "how tool_choice 'auto' finds tool calls in the model's text: hermes (<tool_call>{json}</tool_call>), "
        "llama3_json ({\"name\", \"parameters\"}), or auto: the one the chat template writes (docs/http.md)",
        default=HttpConfig.tool_call_parser, choices=PARSERS, into=HttpConfig)
    http_header_timeout_s: float = flag(HTTP,
        "a request's line and headers must arrive within this, counted from the connection's opening or the request's "
        "first byte; slower or silent connections are closed",
        default=HttpConfig.header_timeout_s, into=HttpConfig, field="header_timeout_s")
    http_body_timeout_s: float = flag(HTTP,
        "a request's body must arrive within this after its headers; a slower connection is closed (bodies are at most "
        "--max-message-bytes)",
        default=HttpConfig.body_timeout_s, into=HttpConfig, field="body_timeout_s")
    http_max_connections: int = flag(HTTP,
        "open HTTP connections; more are closed as they are accepted (keep it under the open-files limit)",
        default=HttpConfig.max_connections, into=HttpConfig, field="max_connections")

    admin_token_file: str | None = flag(SECURITY,
        "file holding the bearer token LoadAdapter/UnloadAdapter require (or set LORAPLEX_ADMIN_TOKEN); without one, "
        "admin RPCs are PERMISSION_DENIED on a non-loopback --listen (open on loopback)")
    insecure_admin: bool = flag(SECURITY, "admin RPCs without a token on a non-loopback address too", into=ServerConfig)
    tls_cert: str | None = flag(SECURITY, "server certificate (PEM); enables TLS", into=ServerConfig)
    tls_key: str | None = flag(SECURITY, "server private key (PEM)", into=ServerConfig)
    tls_client_ca: str | None = flag(SECURITY, "CA (PEM) client certificates must chain to; enables mTLS",
        into=ServerConfig)

    tenants_file: str | None = flag(TENANTS,
        "JSON or YAML {tenants: [{name, token_sha256 | token_file, admin, max_running, max_queued, tokens_per_minute, "
        "weight, mtls_common_name, min_priority, via_trusted_header, cache_group, sources, max_adapters, "
        "adapter_pool_bytes}]} (docs/tenants.md): bearer tokens (gRPC metadata or HTTP Authorization) name tenants. "
        "With any tenant configuration (this file, --trusted-tenant-header, --tls-client-ca) a request without a valid "
        "credential is UNAUTHENTICATED (HTTP 401), unless an entry {name: anonymous, anonymous: true, <limits>} "
        "declares the anonymous tenant")
    trusted_tenant_header: str | None = flag(TENANTS,
        "header (gRPC metadata key) a gateway in front sets to name the tenant; honoured only when set, and only for "
        "tenants whose entry says via_trusted_header: true (a bearer token, when present, decides instead). The port "
        "must then be reachable only through that gateway")
    tenant_metrics_top_k: int = flag(TENANTS,
        "tenants with their own label in the loraplex_tenant_* series (the rest: tenant=\"other\")",
        default=ServerConfig.tenant_metrics_top_k, into=ServerConfig)
    state_dir: str | None = flag(TENANTS,
        "directory for state that outlives the process: the adapters loaded through the API, with their tenants, "
        "registered again at start (mount a volume here; docs/tenants.md)",
        into=ServerConfig)
