"""The server's settings that both front ends read (the engine's live in EngineConfig, the HTTP
listener's own in http/config.py), and the tenant state they share through it."""

from __future__ import annotations

from dataclasses import dataclass, field

from adapter_cache.uri_policy import UriPolicy
from inference_service.frontend.grammar_check import COMPILE_CPU_S, COMPILE_PROCESSES
from inference_service.frontend.preload import PreloadEntry
from inference_service.frontend.tenant_adapters import TenantAdapters
from inference_service.frontend.tenants import Tenancy, TenantSpec


@dataclass
class ServerConfig:
    """Server-only settings (the engine's live in EngineConfig)."""

    listen: str = "127.0.0.1:50051"
    metrics_port: int = 0  # 0: no /metrics endpoint
    metrics_addr: str = "127.0.0.1"
    admin_token: str | None = None
    insecure_admin: bool = False  # allow admin RPCs without a token on a non-loopback address
    adapter_source_allow: tuple[str, ...] = ()
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # set: clients must present a certificate signed by it (mTLS)
    max_message_bytes: int = 4 * 1024 * 1024
    default_max_new_tokens: int | None = None  # None: the rest of the context after the prompt
    grammar_compile_cpu_s: float = COMPILE_CPU_S  # structured output: a new constraint's compile bound
    grammar_compile_wall_s: float = 0.0  # and its wall-clock bound (0: grammar_check.default_wall_s)
    grammar_check_processes: int = COMPILE_PROCESSES  # compile children checking new constraints side by side
    adapter_metrics_top_k: int = 20
    preload: list[PreloadEntry] = field(default_factory=list)
    preload_file: str | None = None  # re-read every preload_reload_s (0: read once)
    preload_reload_s: float = 10.0
    lora_modules: list[PreloadEntry] = field(default_factory=list)  # --lora-modules: kept loaded, never reloaded
    # SIGTERM: health NOT_SERVING at once; new RPCs still served for drain_delay_s (clients and
    # load balancers see NOT_SERVING and move away); then new RPCs are refused and in-flight ones
    # get what is left of shutdown_grace_s before they are cancelled.
    shutdown_grace_s: float = 30.0
    drain_delay_s: float = 0.0
    watchdog_stall_s: float = 60.0  # a scheduler step this long: NOT_SERVING, liveness fails (0: no stall check)
    adapter_resolver: str = ""  # URI template with {name}: unregistered adapters load on first use
    health_listen: str = ""  # HOST:PORT: grpc.health.v1 alone, plaintext (kubelet probes when --listen has TLS)
    # Who may share prefix-cached KV (frontend/cache_salt.py): shared | listener | identity (None:
    # identity with any tenant configuration, else shared; see cache_scope), and the operator's salt
    # mixed into every key
    prefix_cache_scope: str | None = None
    prefix_cache_salt: str | None = None
    # Tenants (frontend/tenants.py): --tenants-file's entries, the operator's trusted header, and the
    # tenants with their own label in the per-tenant metrics
    tenants: tuple[TenantSpec, ...] = ()
    trusted_tenant_header: str | None = None
    tenant_metrics_top_k: int = 10
    state_dir: str | None = None  # adapters loaded through the API are kept here across restarts
    _tenancy: Tenancy | None = field(default=None, init=False, repr=False, compare=False)
    _adapters: TenantAdapters | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def tenancy(self) -> Tenancy:
        """The tenant state both front ends of this server share (bindings, quotas, metrics)."""
        if self._tenancy is None:
            self._tenancy = Tenancy(self.tenants, self.admin_token, self.trusted_tenant_header,
                                    self.tenant_metrics_top_k, mtls=self.tls_client_ca is not None)
        return self._tenancy

    @property
    def adapters(self) -> TenantAdapters:
        """The adapter namespaces, sources and limits both front ends of this server share."""
        if self._adapters is None:
            self._adapters = TenantAdapters(self.tenants, UriPolicy(self.adapter_source_allow), self.state_dir,
                                            self.tenant_metrics_top_k)
        return self._adapters

    @property
    def cache_scope(self) -> str:
        """The prefix-cache scope in force: the operator's, else per tenant whenever tenants are
        configured (a prompt's cache hit must not tell one tenant what another sent)."""
        if self.prefix_cache_scope is not None:
            return self.prefix_cache_scope
        return "identity" if self.tenancy.enabled else "shared"
