"""Adapter namespaces: the name mapping cannot be gamed, and no sequence of tenants' loads, unloads,
reloads, generations, lists and evictions lets one tenant observe another's adapter, cache hit or name.

The mapping's properties are checked on names hypothesis builds (separators, the engine's own form,
unicode tenant names). The state machine drives the real gRPC servicer over a real in-process engine
(builtin:tiny, two adapter slots, so adapters are evicted and reloaded as it goes) with a tenants
configuration, and holds every answer to a model of who bound what."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from adapter_cache.errors import InvalidArgumentError
from inference_service.api import inference_pb2 as pb
from inference_service.api import inference_pb2_grpc as pb_grpc
from inference_service.demo_adapters import write_peft_adapter
from inference_service.engine.config import EngineConfig
from inference_service.engine.in_process import Engine
from inference_service.frontend import namespace
from inference_service.frontend.grpc_server import ServerConfig, build_server
from inference_service.frontend.tenants import ADMIN, ANONYMOUS, Tenant, TenantSpec
from inference_service.limits import ADAPTER_NAME_PATTERN, check_adapter_name

ADMIN_TOKEN = "namespace-admin-token"
TENANTS = ("alice", "bob", "Ω-ünïcode tenant")
TOKENS = {name: f"tenant-token-{i}" for i, name in enumerate(TENANTS)}  # gRPC metadata is ASCII
MAX_ADAPTERS = 3
WEIGHTS = 4  # adapter directories w0..w3, every tenant may load any of them
PROMPTS = ("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
           "seventeen eighteen nineteen twenty", "a b c d e f g h i j k l m n o p q r s t u v w x y z a b c d e f")

_bare = st.from_regex(ADAPTER_NAME_PATTERN, fullmatch=True).filter(lambda n: not namespace.is_engine_only(n))
_tenant = st.text(min_size=1, max_size=128)


# ---- the mapping ------------------------------------------------------------------------------

@given(_tenant, _bare, _tenant, _bare)
@settings(max_examples=300, deadline=None)
def test_engine_names_are_one_to_one_and_never_a_bare_name(t1: str, n1: str, t2: str, n2: str) -> None:
    assume(len(n1) <= namespace.MAX_TENANT_NAME and len(n2) <= namespace.MAX_TENANT_NAME)
    e1, e2 = namespace.engine_name(t1, n1), namespace.engine_name(t2, n2)
    check_adapter_name(e1)  # the engine takes it
    assert (e1 == e2) == ((t1, n1) == (t2, n2))
    assert namespace.split(e1) == (namespace.tenant_digest(t1), n1)
    assert namespace.split(n1) == (None, n1)  # a bare (shared) name is never a tenant's engine name
    assert e1 != namespace.engine_name(None, n2)


@pytest.mark.parametrize("name", ["foo__" + "0" * 32, "a__" + namespace.tenant_digest("alice"),
                                  "x____" + "f" * 32])
def test_a_name_of_the_engines_tenant_form_is_refused_to_tenants(name: str) -> None:
    alice = Tenant("alice", spec=TenantSpec("alice"))
    with pytest.raises(InvalidArgumentError):
        namespace.resolve(alice, name, lambda _: True)
    with pytest.raises(InvalidArgumentError):
        namespace.engine_name(None, name)
    assert namespace.resolve(Tenant(ADMIN, admin=True), name, lambda _: False) == name  # admins address it


@pytest.mark.parametrize("bare", ["foo_", "foo__", "foo__abc", "foo-" + "0" * 32, "foo__" + "0" * 31,
                                  "foo__" + "0" * 33, "FOO__" + "A" * 32, "foo.__" + "0" * 32 + "x"])
def test_separator_lookalikes_stay_bare_names(bare: str) -> None:
    """Names that look like the separator but are not the engine's form map to distinct engine names."""
    assert not namespace.is_engine_only(bare)
    names = {namespace.engine_name(t, bare) for t in ("alice", "bob")} | {namespace.engine_name(None, bare)}
    assert len(names) == 3
    assert all(namespace.split(n)[1] == bare for n in names)


def test_the_implicit_anonymous_tenant_and_the_admin_token_load_shared_adapters() -> None:
    assert namespace.owner_of(Tenant(ANONYMOUS)) is None  # a server without tenant configuration
    assert namespace.owner_of(Tenant(ADMIN, admin=True)) is None
    assert namespace.owner_of(Tenant(ANONYMOUS, spec=TenantSpec(ANONYMOUS))) == ANONYMOUS  # a declared one
    assert namespace.owner_of(Tenant("ops", admin=True, spec=TenantSpec("ops", admin=True))) == "ops"


# ---- the state machine ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[Engine, grpc.Channel, Path, dict[tuple[int, int], list[int]]]]:
    root = tmp_path_factory.mktemp("namespace-adapters")
    for i in range(WEIGHTS):
        write_peft_adapter(root / f"w{i}", rank=4, seed=90 + i)
    engine = Engine(EngineConfig(model="builtin:tiny", device="cpu", max_loras=2, max_lora_rank=8,
                                 max_new_tokens_limit=16))
    engine.start()
    specs = tuple(TenantSpec(name, token_sha256=hashlib.sha256(token.encode()).digest(),
                             sources=(root.as_uri(),), max_adapters=MAX_ADAPTERS) for name, token in TOKENS.items())
    config = ServerConfig(listen="127.0.0.1:0", adapter_source_allow=(root.as_uri(),), admin_token=ADMIN_TOKEN,
                          tenants=specs)
    loop = asyncio.new_event_loop()
    ready, stop = threading.Event(), asyncio.Event()
    port: list[int] = []

    async def serve() -> None:
        running = await build_server(engine, config)
        port.append(running.port)
        ready.set()
        await stop.wait()
        await running.stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(60)
    channel = grpc.insecure_channel(f"127.0.0.1:{port[0]}")
    try:
        stub = pb_grpc.InferenceStub(channel)
        reference: dict[tuple[int, int], list[int]] = {}  # (weights, prompt) → tokens; weights -1: the base model
        for p in range(len(PROMPTS)):
            reference[(-1, p)] = _generate(stub, ADMIN, BASE, p)[0]
        for w in range(WEIGHTS):
            name = f"reference-w{w}"
            stub.LoadAdapter(pb.LoadAdapterRequest(name=name, uri=(root / f"w{w}").as_uri(), shared=True),
                             metadata=_md(ADMIN), timeout=60)
            for p in range(len(PROMPTS)):
                reference[(w, p)] = _generate(stub, ADMIN, name, p)[0]
            stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), metadata=_md(ADMIN), timeout=60)
        assert len({tuple(v) for v in reference.values()}) == len(reference), "weights too alike to tell apart"
        yield engine, channel, root, reference
    finally:
        channel.close()
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        engine.shutdown()


def _md(who: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {ADMIN_TOKEN if who == ADMIN else TOKENS[who]}"),)


def _generate(stub: pb_grpc.InferenceStub, who: str, adapter: str, prompt: int) -> tuple[list[int], int]:
    req = pb.GenerateRequest(text=PROMPTS[prompt], adapter=adapter, max_new_tokens=4, ignore_eos=True)
    out = list(stub.Generate(req, metadata=_md(who), timeout=60))
    return [t for r in out for t in r.token_ids], out[-1].usage.cached_tokens


def _code(call) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


SENT: dict[str, set[int]] = {t: set() for t in TENANTS}  # prompts each tenant sent to the module's server
BASE = ""  # the base model: no adapter
NAMES = (BASE, "foo", "bar", "Foo", "foo_", "foo__", "foo__" + namespace.tenant_digest("bob"))
tenants = st.sampled_from(TENANTS)
names = st.sampled_from(NAMES)
weights = st.integers(0, WEIGHTS - 1)
prompts = st.integers(0, len(PROMPTS) - 1)


class NamespaceMachine(RuleBasedStateMachine):
    """The model: who bound which name to which weights; every answer must follow from it alone."""

    def __init__(self, served: tuple[Engine, grpc.Channel, Path, dict[tuple[int, int], list[int]]]) -> None:
        super().__init__()
        self.engine, channel, self.root, self.reference = served
        self.stub = pb_grpc.InferenceStub(channel)
        self.bound: dict[tuple[str | None, str], int] = {}  # (tenant or None: shared, name) → weights
        # prompts each tenant has sent on this server (its prefix cache outlives one example)
        self.sent = SENT

    def _uri(self, w: int) -> str:
        return (self.root / f"w{w}").as_uri()

    def _own(self, tenant: str) -> set[str]:
        return {n for (t, n) in self.bound if t == tenant}

    def _shared(self) -> set[str]:
        return {n for (t, n) in self.bound if t is None}

    def teardown(self) -> None:
        for (tenant, name) in list(self.bound):
            self.stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), metadata=_md(tenant or ADMIN), timeout=60)
        self.bound.clear()

    @rule(tenant=tenants, name=names, w=weights)
    def load(self, tenant: str, name: str, w: int) -> None:
        assume(name != BASE)
        code, details = _code(lambda: self.stub.LoadAdapter(
            pb.LoadAdapterRequest(name=name, uri=self._uri(w)), metadata=_md(tenant), timeout=60))
        if namespace.is_engine_only(name):
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        elif name not in self._own(tenant) and len(self._own(tenant)) >= MAX_ADAPTERS:
            assert code == grpc.StatusCode.FAILED_PRECONDITION, details
        else:
            assert code == grpc.StatusCode.OK, details
            self.bound[(tenant, name)] = w  # a load of a name it holds is a reload: the new weights

    @rule(name=names, w=weights)
    def load_shared(self, name: str, w: int) -> None:
        assume(name != BASE and not namespace.is_engine_only(name))
        self.stub.LoadAdapter(pb.LoadAdapterRequest(name=name, uri=self._uri(w), shared=True),
                              metadata=_md(ADMIN), timeout=60)
        self.bound[(None, name)] = w

    @rule(tenant=tenants, name=names)
    def unload(self, tenant: str, name: str) -> None:
        assume(name != BASE)
        code, details = _code(lambda: self.stub.UnloadAdapter(
            pb.UnloadAdapterRequest(name=name), metadata=_md(tenant), timeout=60))
        if namespace.is_engine_only(name):
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        elif name in self._own(tenant):
            assert code == grpc.StatusCode.OK, details
            del self.bound[(tenant, name)]
        elif name in self._shared():
            assert code == grpc.StatusCode.PERMISSION_DENIED, details
        else:  # another tenant's name or none: the same words
            assert (code, details) == (grpc.StatusCode.NOT_FOUND, f"unknown adapter {name!r}")

    @rule(name=names)
    def unload_shared(self, name: str) -> None:
        assume((None, name) in self.bound)
        self.stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), metadata=_md(ADMIN), timeout=60)
        del self.bound[(None, name)]

    @rule(tenant=tenants, name=names, prompt=prompts)
    def generate(self, tenant: str, name: str, prompt: int) -> None:
        """The tokens of the weights the tenant bound (else the shared ones); a cache hit only for a
        prompt this tenant sent before. Each generation also moves adapters through the two slots."""
        w = -1 if name == BASE else self.bound.get((tenant, name), self.bound.get((None, name)))
        got: list[tuple[list[int], int]] = []
        code, details = _code(lambda: got.append(_generate(self.stub, tenant, name, prompt)))
        if namespace.is_engine_only(name):
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            return
        if w is None:
            assert (code, details) == (grpc.StatusCode.NOT_FOUND, f"unknown adapter {name!r}")
            return
        assert code == grpc.StatusCode.OK, details
        tokens, cached = got[0]
        assert tokens == self.reference[(w, prompt)]
        assert cached == 0 or prompt in self.sent[tenant], "a cache hit on a prompt only another tenant sent"
        self.sent[tenant].add(prompt)

    @rule(tenant=tenants)
    def list_adapters(self, tenant: str) -> None:
        listed = [a.name for a in self.stub.ListAdapters(pb.ListAdaptersRequest(), metadata=_md(tenant),
                                                         timeout=60).adapters]
        assert sorted(listed) == sorted(self._own(tenant) | self._shared())

    @invariant()
    def engine_names_follow_the_model(self) -> None:
        registered = {a.name for a in self.engine.list_adapters().result(60) if self.engine.adapter_is_current(a.name)}
        expected = {namespace.engine_name(t, n) for (t, n) in self.bound}
        assert registered == expected


def test_no_tenant_observes_another_tenants_adapter_cache_hit_or_name(served) -> None:
    run_state_machine_as_test(lambda: NamespaceMachine(served), settings=settings(
        max_examples=25, stateful_step_count=20, deadline=None, suppress_health_check=list(HealthCheck)))
