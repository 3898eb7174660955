"""Tenants: identity from the trusted side, adapters bound to tenants, quotas, metrics, prefix cache.

Real servers in subprocesses; every bad input gets its exact status on both front ends, and the
server is clean (no leak, SERVING, no traceback) afterwards."""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest

from adapter_cache.errors import InvalidArgumentError, PermissionDeniedError, UnauthenticatedError
from harness.inference_server import InferenceServer, start_inference_server
from harness.isolation import VICTIM_PROMPT, assert_clean, solo_run, victim_beside
from harness.waiting import wait_until
from inference_service.api import inference_pb2 as pb
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter
from inference_service.frontend.namespace import engine_name
from inference_service.frontend.tenants import (
    ANONYMOUS,
    QuotaExceeded,
    Tenancy,
    TenantSpec,
    parse_tenants,
)

pytestmark = pytest.mark.slow
ADMIN_TOKEN = "the-operators-admin-token"
TOKENS = {"alpha": "alpha-token-1", "beta": "beta-token-2", "limited": "limited-token-3", "rated": "rated-token-4",
          "ops": "ops-token-5", "suspended": "suspended-token-6", "sampler": "sampler-token-7",
          "teammate": "teammate-token-8", "flooder": "flooder-token-9"}
BASE = "builtin:tiny"
RATE = 400  # rated's tokens per minute
FLOOD_RATE = 300  # flooder's


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _tenants_file(tmp: Path, anonymous: bool = True) -> Path:
    """The tenants: alpha and beta also through the trusted header; limited (1 in flight), sampler (3
    in flight), rated (RATE tokens a minute), suspended (0 in flight); ops an admin; rated and
    teammate in one prefix-cache group; and, unless told not to, the anonymous tenant (2 in flight)."""
    (tmp / "beta.token").write_text(TOKENS["beta"] + "\n")
    data = {"tenants": [
        {"name": "alpha", "token_sha256": _sha(TOKENS["alpha"]), "via_trusted_header": True,
         "sources": [(tmp / "adapters").as_uri()]},
        {"name": "beta", "token_file": "beta.token", "min_priority": -5, "via_trusted_header": True,
         "sources": [(tmp / "adapters").as_uri()]},
        {"name": "limited", "token_sha256": _sha(TOKENS["limited"]), "max_running": 1, "max_queued": 0},
        {"name": "sampler", "token_sha256": _sha(TOKENS["sampler"]), "max_running": 2, "max_queued": 1},
        {"name": "rated", "token_sha256": _sha(TOKENS["rated"]), "tokens_per_minute": RATE, "cache_group": "team"},
        {"name": "teammate", "token_sha256": _sha(TOKENS["teammate"]), "cache_group": "team"},
        {"name": "ops", "token_sha256": _sha(TOKENS["ops"]), "admin": True},
        {"name": "flooder", "token_sha256": _sha(TOKENS["flooder"]), "tokens_per_minute": FLOOD_RATE},
        {"name": "suspended", "token_sha256": _sha(TOKENS["suspended"]), "max_running": 0, "max_queued": 0},
    ]}
    if anonymous:
        data["tenants"].append({"name": "anonymous", "anonymous": True, "max_running": 2, "max_queued": 0})
    path = tmp / ("tenants.json" if anonymous else "tenants-no-anonymous.json")
    path.write_text(json.dumps(data))
    return path


def _md(tenant: str | None = None, raw: str | None = None) -> tuple[tuple[str, str], ...]:
    if raw is not None:
        return (("authorization", raw),)
    return (("authorization", f"Bearer {TOKENS[tenant]}"),) if tenant else ()


def _headers(tenant: str | None = None, raw: str | None = None, **extra: str) -> dict[str, str]:
    if raw is not None:
        return {"Authorization": raw, **extra}
    return {**({"Authorization": f"Bearer {TOKENS[tenant]}"} if tenant else {}), **extra}


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[tuple[InferenceServer, Path]]:
    tmp = tmp_path_factory.mktemp("tenants")
    root = tmp / "adapters"
    for i, name in enumerate(("a-private", "b-private", "shared")):
        write_peft_adapter(root / name, rank=4, seed=30 + i)
    server = start_inference_server(
        ["--tenants-file", str(_tenants_file(tmp)), "--trusted-tenant-header", "x-tenant",
         "--adapter-source-allow", root.as_uri(), "--prefix-cache-scope", "identity",
         "--max-new-tokens-limit", "1000", "--tenant-metrics-top-k", "20"],
        env={"LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN}, log_dir=tmp, http=True)
    try:
        with InferenceClient(server.address, token=TOKENS["alpha"]) as alpha:
            alpha.load_adapter("a-private", (root / "a-private").as_uri(), timeout=60)
        with InferenceClient(server.address, token=ADMIN_TOKEN) as admin:
            admin.load_adapter("shared", (root / "shared").as_uri(), timeout=60)
        r = httpx.post(server.http_url + "/v1/load_lora_adapter", headers=_headers("beta"), timeout=60,
                       json={"lora_name": "b-private", "lora_path": str(root / "b-private")})
        assert r.status_code == 200, r.text
        yield server, root
    finally:
        server.stop()


def _code(fn: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details()
    raise AssertionError("the call succeeded")


def _generate(server: InferenceServer, md, adapter: str = "", max_new_tokens: int = 2,  # type: ignore[no-untyped-def]
              prompt: str = "hello") -> list[pb.GenerateResponse]:
    with InferenceClient(server.address) as c:
        req = c.request(prompt, adapter=adapter or None, max_new_tokens=max_new_tokens, ignore_eos=True)
        return list(c.stub.Generate(req, metadata=md, timeout=60))


def _list(server: InferenceServer, md) -> set[str]:  # type: ignore[no-untyped-def]
    with InferenceClient(server.address) as c:
        return {a.name for a in c.stub.ListAdapters(pb.ListAdaptersRequest(), metadata=md, timeout=30).adapters}


def _complete(server: InferenceServer, headers: dict[str, str], model: str = "builtin:tiny", max_tokens: int = 2,
              prompt: str = "hello") -> httpx.Response:
    return httpx.post(server.http_url + "/v1/completions", headers=headers, timeout=60,
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})


def _models(server: InferenceServer, headers: dict[str, str]) -> set[str]:
    r = httpx.get(server.http_url + "/v1/models", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return {m["id"] for m in r.json()["data"]}


def test_bad_credentials_have_exact_statuses(env) -> None:
    server, _ = env
    for raw in ("Bearer not-a-tenant", "Basic YWxhZGRpbjpvcGVuc2VzYW1l", "Bearer", "Token abc", TOKENS["alpha"]):
        assert _code(lambda raw=raw: _generate(server, _md(raw=raw)))[0] == grpc.StatusCode.UNAUTHENTICATED, raw
        assert _code(lambda raw=raw: _list(server, _md(raw=raw)))[0] == grpc.StatusCode.UNAUTHENTICATED, raw
        for response in (_complete(server, _headers(raw=raw)),
                         httpx.get(server.http_url + "/v1/models", headers=_headers(raw=raw), timeout=30)):
            assert response.status_code == 401, (raw, response.text)
            assert response.headers["www-authenticate"] == "Bearer"
            assert response.json()["error"]["code"] == "UNAUTHENTICATED"
    # a tenant's token is not an admin token, and an unbound adapter is the operator's
    assert _code(lambda: _unload(server, "shared", _md("alpha")))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert_clean(server)


def _refused_everywhere(server: InferenceServer, md: tuple[tuple[str, str], ...], why: str) -> None:
    """UNAUTHENTICATED on gRPC and 401 (with its Bearer challenge) on HTTP, for a generate and a list."""
    assert _code(lambda: _generate(server, md))[0] == grpc.StatusCode.UNAUTHENTICATED, why
    assert _code(lambda: _list(server, md))[0] == grpc.StatusCode.UNAUTHENTICATED, why
    for response in (httpx.post(server.http_url + "/v1/completions", headers=list(md), timeout=60,
                                json={"model": BASE, "prompt": "hello", "max_tokens": 2}),
                     httpx.get(server.http_url + "/v1/models", headers=list(md), timeout=30)):
        assert response.status_code == 401, (why, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "UNAUTHENTICATED"


def test_each_requests_outcome_is_logged_with_its_tenant(env) -> None:
    """gRPC and HTTP: the request's one outcome line names the tenant its credential is, and a
    request whose credential is refused names none."""
    server, _ = env
    with InferenceClient(server.address) as c:
        req = c.request("hello", max_new_tokens=2, ignore_eos=True, request_id="tenant-logged-grpc")
        list(c.stub.Generate(req, metadata=_md("beta"), timeout=60))
    r = httpx.post(server.http_url + "/v1/completions", headers=_headers("alpha"), timeout=60,
                   json={"model": "builtin:tiny", "prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    http_id = r.json()["id"]
    refused, _ = _code(lambda: _generate(server, _md(raw="not-a-known-token")))
    assert refused == grpc.StatusCode.UNAUTHENTICATED

    def line(needle: str) -> str:
        wait_until(lambda: any(needle in ln for ln in server.log().splitlines()), f"the log line of {needle}")
        return next(ln for ln in server.log().splitlines() if needle in ln)

    assert line("request tenant-logged-grpc adapter=").endswith(" tenant=beta")
    assert line(f"request {http_id} adapter=").endswith(" tenant=alpha")
    assert any(" code=UNAUTHENTICATED " in ln and ln.endswith(" tenant=-") for ln in server.log().splitlines())


def test_a_repeated_identity_header_is_refused(env) -> None:
    """Two Authorization values or two trusted-header values: which one counts would be a guess (a
    gateway appends its value to the client's), so the request is refused whatever the values."""
    server, _ = env
    auth = f"Bearer {TOKENS['alpha']}"
    for md, why in (((("authorization", auth), ("authorization", f"Bearer {TOKENS['beta']}")), "two tokens"),
                    ((("authorization", auth), ("authorization", auth)), "the same token twice"),
                    ((("x-tenant", "alpha"), ("x-tenant", "beta")), "two tenants in the header"),
                    ((("x-tenant", "alpha"), ("x-tenant", "alpha")), "the same tenant twice")):
        _refused_everywhere(server, md, why)
    assert _tenant_samples(server, "loraplex_tenant_requests_waiting").get(("alpha",), 0) == 0
    assert_clean(server)


def test_a_trusted_header_names_only_tenants_that_accept_it(env) -> None:
    """alpha and beta opt in (via_trusted_header); limited, the admin tenant and unknown or reserved
    names do not exist for the header."""
    server, _ = env
    for name in ("limited", "ops", "admin", "anonymous", "no-such-tenant", ""):
        _refused_everywhere(server, (("x-tenant", name),), name)
    assert _list(server, (("x-tenant", "alpha"),)) == {"a-private", "shared"}
    assert _complete(server, {"x-tenant": "beta"}, "b-private").status_code == 200
    assert_clean(server)


def test_a_token_decides_over_the_trusted_header(env) -> None:
    """Token and header together: the token names the tenant and the header is ignored (what a
    gateway asserts cannot override what the client proved); a bad token stays a bad token."""
    server, _ = env
    alpha_and_beta_header = (("authorization", f"Bearer {TOKENS['alpha']}"), ("x-tenant", "beta"))
    assert _list(server, alpha_and_beta_header) == {"a-private", "shared"}
    assert _models(server, dict(alpha_and_beta_header)) - {BASE} == {"a-private", "shared"}
    assert _complete(server, dict(alpha_and_beta_header), "b-private").status_code == 404
    assert _generate(server, alpha_and_beta_header, "a-private")[-1].finish_reason == pb.FINISH_REASON_LENGTH
    # the quota followed the token: a limited tenant's token with alpha's header is limited's request
    limited_and_alpha_header = (("authorization", f"Bearer {TOKENS['limited']}"), ("x-tenant", "alpha"))
    before = server.value("loraplex_tenant_generated_tokens_total", tenant="limited")
    assert _generate(server, limited_and_alpha_header, max_new_tokens=3)[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert server.value("loraplex_tenant_generated_tokens_total", tenant="limited") == before + 3
    _refused_everywhere(server, (("authorization", "Bearer not-a-tenant"), ("x-tenant", "alpha")), "bad token")
    admin_and_header = (("authorization", f"Bearer {ADMIN_TOKEN}"), ("x-tenant", "alpha"))
    assert _list(server, admin_and_header) == _list(server, _md(raw=f"Bearer {ADMIN_TOKEN}"))
    assert_clean(server)


def _unload(server: InferenceServer, name: str, md) -> None:  # type: ignore[no-untyped-def]
    with InferenceClient(server.address) as c:
        c.stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), metadata=md, timeout=30)


def test_adapters_are_bound_to_the_tenant_that_loaded_them(env) -> None:
    server, root = env
    assert _list(server, _md("alpha")) == {"a-private", "shared"}
    assert _list(server, _md("beta")) == {"b-private", "shared"}
    assert _list(server, ()) == {"shared"}  # anonymous
    # admins see engine names: a tenant's adapter carries its tenant's digest (frontend/namespace.py)
    engine_names = {engine_name("alpha", "a-private"), engine_name("beta", "b-private"), "shared"}
    assert _list(server, _md("ops")) == _list(server, _md(raw=f"Bearer {ADMIN_TOKEN}")) == engine_names
    assert _models(server, _headers("alpha")) - {BASE} == {"a-private", "shared"}
    assert _models(server, _headers("beta")) - {BASE} == {"b-private", "shared"}
    assert _models(server, {}) - {BASE} == {"shared"}
    # The owner uses its adapter; for anyone else it is exactly a name that does not exist.
    assert _generate(server, _md("alpha"), "a-private")[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert _complete(server, _headers("beta"), "b-private").status_code == 200
    missing = _code(lambda: _generate(server, _md("beta"), "no-such-adapter"))
    for md in (_md("beta"), (), _md("limited")):
        code, details = _code(lambda md=md: _generate(server, md, "a-private"))
        assert (code, details.replace("a-private", "no-such-adapter")) == missing
    gone = _complete(server, _headers("alpha"), "no-such-adapter")
    assert gone.status_code == 404
    hidden = _complete(server, _headers("alpha"), "b-private")
    assert hidden.status_code == 404
    assert hidden.json()["error"]["message"].replace("b-private", "no-such-adapter") == gone.json()["error"]["message"]
    assert httpx.post(server.http_url + "/tokenize", headers=_headers("alpha"), timeout=30,
                      json={"model": "b-private", "prompt": "x"}).status_code == 404
    # Another tenant can neither unload alpha's adapter nor see it; its own adapter of the same name
    # is its own (and gone again when it unloads it), alpha's is untouched.
    assert _code(lambda: _unload(server, "a-private", _md("beta")))[0] == grpc.StatusCode.NOT_FOUND
    r = httpx.post(server.http_url + "/v1/unload_lora_adapter", headers=_headers("alpha"),
                   json={"lora_name": "b-private"}, timeout=30)
    assert r.status_code == 404, r.text
    with InferenceClient(server.address, token=TOKENS["beta"]) as beta:
        beta.load_adapter("a-private", (root / "b-private").as_uri(), timeout=60)
    assert _list(server, _md("beta")) == {"a-private", "b-private", "shared"}
    assert _list(server, _md("alpha")) == {"a-private", "shared"}
    _unload(server, "a-private", _md("beta"))
    with InferenceClient(server.address, token=TOKENS["alpha"]) as alpha:
        alpha.load_adapter("a-private", (root / "a-private").as_uri(), timeout=60)
    # The operator's trusted header names a tenant (this server sets --trusted-tenant-header x-tenant).
    r = _complete(server, {"x-tenant": "alpha"}, "a-private")
    assert r.status_code == 200, r.text
    assert _generate(server, (("x-tenant", "alpha"),), "a-private")[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert _complete(server, {"x-tenant": "beta"}, "a-private").status_code == 404
    assert_clean(server)


def _tenant_samples(server: InferenceServer, name: str) -> dict[tuple[str, ...], float]:
    return {tuple(v for _, v in labels): value for (n, labels), value in server.samples().items() if n == name}


def test_request_quota_refuses_with_a_retry_hint_and_is_counted(env) -> None:
    server, _ = env
    refused_before = server.value("loraplex_tenant_quota_refusals_total", tenant="limited", quota="requests")
    with InferenceClient(server.address) as c:
        # long enough (seconds) to still be streaming through the checks below
        held = c.stub.Generate(c.request("a long one", max_new_tokens=900, ignore_eos=True), metadata=_md("limited"),
                               timeout=60)
        next(held)  # streaming: the tenant's one request is running
        try:
            with pytest.raises(grpc.RpcError) as e:
                _generate(server, _md("limited"))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            hint = dict(e.value.trailing_metadata() or ())
            assert 1 <= int(hint["retry-after-ms"]) <= 2000, hint
            r = _complete(server, _headers("limited"))
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert _tenant_samples(server, "loraplex_tenant_requests_running")[("limited",)] == 1
            # other tenants are untouched by it
            assert _complete(server, _headers("alpha")).status_code == 200
        finally:
            held.cancel()
    assert server.value("loraplex_tenant_quota_refusals_total", tenant="limited",
                        quota="requests") == refused_before + 2
    deadline = time.monotonic() + 10
    while _tenant_samples(server, "loraplex_tenant_requests_running").get(("limited",)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _generate(server, _md("limited"))[-1].finish_reason == pb.FINISH_REASON_LENGTH  # its slot came back
    # Requests refused after admission (an unknown adapter, a bad constraint) give their slot back.
    for _ in range(2):
        assert _code(lambda: _generate(server, _md("limited"), "no-such-adapter"))[0] == grpc.StatusCode.NOT_FOUND
        assert _complete(server, _headers("limited"), "no-such-adapter").status_code == 404
        bad = httpx.post(server.http_url + "/v1/completions", headers=_headers("limited"), timeout=60,
                         json={"model": BASE, "prompt": "x", "max_tokens": 2,
                               "structured_outputs": {"regex": "("}})
        assert bad.status_code == 400, bad.text
    assert _complete(server, _headers("limited")).status_code == 200
    assert _tenant_samples(server, "loraplex_tenant_requests_waiting")[("limited",)] == 0
    assert_clean(server)


@contextlib.contextmanager
def _held(server: InferenceServer, md, n: int = 1) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """A long request of `n` samples streaming for the block's duration (seconds of tokens left);
    cancelled at its end (`_idle` waits until its places are given back)."""
    with InferenceClient(server.address) as c:
        held = c.stub.Generate(c.request("a long one", max_new_tokens=900, ignore_eos=True, n=n), metadata=md,
                               timeout=60)
        next(held)  # streaming: its samples are running
        try:
            yield
        finally:
            held.cancel()


def _idle(server: InferenceServer, tenant: str) -> None:
    """Waits (bounded) until the tenant's cancelled requests have given their places back."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            _tenant_samples(server, gauge).get((tenant,)) for gauge in
            ("loraplex_tenant_requests_running", "loraplex_tenant_requests_waiting")):
        time.sleep(0.05)


def _completion(server: InferenceServer, headers: dict[str, str], n: int, max_tokens: int = 2) -> httpx.Response:
    return httpx.post(server.http_url + "/v1/completions", headers=headers, timeout=60,
                      json={"model": BASE, "prompt": "hello", "max_tokens": max_tokens, "n": n, "ignore_eos": True})


def _generate_n(server: InferenceServer, md, n: int) -> list[pb.GenerateResponse]:  # type: ignore[no-untyped-def]
    with InferenceClient(server.address) as c:
        return list(c.stub.Generate(c.request("hello", max_new_tokens=2, ignore_eos=True, n=n), metadata=md,
                                    timeout=60))


def test_no_credential_is_the_declared_anonymous_tenant_with_its_own_limits(env) -> None:
    """Dropping one's token does not drop one's limits: a request without a credential is the tenant
    the file declares as anonymous (2 in flight here), refused at its cap like any other (a tenant
    at its cap sending without its token meets the anonymous tenant's cap, not none)."""
    server, _ = env
    refused = server.value("loraplex_tenant_quota_refusals_total", tenant="anonymous", quota="requests")
    with _held(server, (), n=2):
        assert _tenant_samples(server, "loraplex_tenant_requests_running")[("anonymous",)] == 2
        assert _code(lambda: _generate(server, ()))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        r = _complete(server, {})
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert _complete(server, _headers("alpha")).status_code == 200  # others are untouched
    _idle(server, "anonymous")
    assert server.value("loraplex_tenant_quota_refusals_total", tenant="anonymous", quota="requests") == refused + 2
    assert _complete(server, {}).status_code == 200
    assert_clean(server)


def test_in_flight_quota_counts_every_sample(env) -> None:
    """sampler may have 3 requests in flight, and a request of n samples is n of them: beside a
    request of 2 samples one more sample fits, two do not (they would if n counted as 1)."""
    server, _ = env
    md, headers = _md("sampler"), _headers("sampler")
    with _held(server, md, n=2):
        assert _tenant_samples(server, "loraplex_tenant_requests_running")[("sampler",)] == 2
        r = _completion(server, headers, n=2)
        assert r.status_code == 429, r.text
        assert _code(lambda: _generate_n(server, md, 2))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        r = _completion(server, headers, n=1)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 1
    _idle(server, "sampler")
    r = _completion(server, headers, n=3)  # the whole cap, once free
    assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
    assert_clean(server)


def test_a_request_that_can_never_fit_its_tenants_caps_is_invalid(env) -> None:
    """More samples than the in-flight cap can never pass: INVALID_ARGUMENT / 400 without a retry
    hint (a 429 would have SDKs retry it forever), counted as no quota refusal; a tenant whose cap is
    0 may run nothing: PERMISSION_DENIED / 403."""
    server, _ = env
    refused = server.value("loraplex_tenant_quota_refusals_total", tenant="sampler", quota="requests")
    r = _completion(server, _headers("sampler"), n=4)
    assert r.status_code == 400, r.text
    assert "retry-after" not in r.headers and "n=4" in r.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as e:
        _generate_n(server, _md("sampler"), 4)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "retry-after-ms" not in dict(e.value.trailing_metadata() or ())
    assert _completion(server, _headers("limited"), n=2).status_code == 400
    assert server.value("loraplex_tenant_quota_refusals_total", tenant="sampler", quota="requests") == refused
    r = _complete(server, _headers("suspended"))
    assert r.status_code == 403, r.text
    assert _code(lambda: _generate(server, _md("suspended")))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert_clean(server)


def test_token_rate_reserves_prompt_and_max_new_tokens(env) -> None:
    server, _ = env
    prompt = "x" * 40  # byte tokenizer: 41 tokens with BOS
    # larger than the whole rate: can never pass, so not a 429 (a client would retry it forever)
    r = _complete(server, _headers("rated"), max_tokens=RATE, prompt=prompt)
    assert r.status_code == 400, r.text
    assert _code(lambda: _generate(server, _md("rated"), max_new_tokens=RATE, prompt=prompt))[0] == \
        grpc.StatusCode.INVALID_ARGUMENT
    # two reservations of ~240 tokens do not fit in 400 per minute; the first's unused part is refunded
    first = _complete(server, _headers("rated"), max_tokens=200, prompt=prompt)
    assert first.status_code == 200, first.text
    second = _complete(server, _headers("rated"), max_tokens=200, prompt=prompt)
    assert second.status_code == 429, second.text
    assert 1 <= int(second.headers["retry-after"]) <= 60
    with pytest.raises(grpc.RpcError) as e:
        _generate(server, _md("rated"), max_new_tokens=200, prompt=prompt)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(e.value.trailing_metadata())["retry-after-ms"]) > 0
    assert server.value("loraplex_tenant_quota_refusals_total", tenant="rated", quota="tokens") >= 2
    assert server.value("loraplex_http_requests_total", route="/v1/completions", code="429") >= 1
    assert _complete(server, _headers("beta")).status_code == 200  # another tenant's rate is its own
    assert_clean(server)


def test_tenant_over_quota_never_fails_another_tenants_stream(env) -> None:
    """A victim (the anonymous tenant) streams beside a tenant that floods both front ends past its
    token rate (flooder: its minute's tokens spent by one request just before): every flood request
    gets RESOURCE_EXHAUSTED / 429 and is counted, and every run of the victim makes exactly its
    tokens alone, its stream never stalls (harness/isolation.py's stall bound)."""
    server, _ = env
    prompt = "x" * 40  # 41 tokens with BOS
    spend = _complete(server, _headers("flooder"), max_tokens=FLOOD_RATE - 50, prompt=prompt)
    assert spend.status_code == 200, spend.text  # 291 of 300 spent: ~50 s until 241 fit again
    base = solo_run(server, max_new_tokens=384)  # long enough that one scheduling hiccup is no stall
    refused_before = server.value("loraplex_tenant_quota_refusals_total", tenant="flooder", quota="tokens")
    outcomes: list[str] = []
    lock = threading.Lock()
    client = InferenceClient(server.address)
    http = httpx.Client(timeout=60)

    def flood_grpc() -> None:
        try:
            req = client.request(prompt, max_new_tokens=200, ignore_eos=True)
            list(client.stub.Generate(req, metadata=_md("flooder"), timeout=60))
            outcome = "OK"
        except grpc.RpcError as e:
            outcome = e.code().name
        with lock:
            outcomes.append(outcome)

    def flood_http() -> None:
        status = http.post(server.http_url + "/v1/completions", headers=_headers("flooder"),
                           json={"model": BASE, "prompt": prompt, "max_tokens": 200}).status_code
        with lock:
            outcomes.append(str(status))

    try:
        with victim_beside(server, base):
            with ThreadPoolExecutor(2) as pool:  # both front ends at once, a request every 50 ms on each
                list(pool.map(lambda i: (time.sleep(0.05), (flood_grpc if i % 2 else flood_http)()), range(48)))
    finally:
        client.close()
        http.close()
    assert sorted(outcomes) == ["429"] * 24 + ["RESOURCE_EXHAUSTED"] * 24, outcomes
    assert server.value("loraplex_tenant_quota_refusals_total", tenant="flooder",
                        quota="tokens") == refused_before + 48
    assert _tenant_samples(server, "loraplex_tenant_generated_tokens_total")[("flooder",)] == FLOOD_RATE - 50


def test_tenant_metrics_stay_at_zero_in_flight(env) -> None:
    server, _ = env
    assert _complete(server, _headers("alpha")).status_code == 200
    assert _generate(server, _md("beta"))[-1].finish_reason == pb.FINISH_REASON_LENGTH
    tokens = _tenant_samples(server, "loraplex_tenant_generated_tokens_total")
    assert tokens[("alpha",)] > 0 and tokens[("beta",)] > 0
    for name in ("loraplex_tenant_requests_running", "loraplex_tenant_requests_waiting"):
        samples = _tenant_samples(server, name)
        assert sum(samples.values()) == 0, (name, samples)
    # a tenant never sees another's name: not in its lists, errors or model cards
    text = json.dumps(httpx.get(server.http_url + "/v1/models", headers=_headers("beta"), timeout=30).json())
    assert "alpha" not in text and "a-private" not in text


def test_api_port_metrics_need_an_admin_credential(env) -> None:
    """The API port's /metrics names every tenant's adapters and tenants: with tenants configured it
    is the admin's (403 for a tenant's credential and for the anonymous tenant, 401 for a bad one),
    while the metrics port stays open for Prometheus inside the cluster."""
    server, _ = env
    assert _generate(server, _md("alpha"), "a-private")[-1].finish_reason == pb.FINISH_REASON_LENGTH
    url = server.http_url + "/metrics"
    for headers in ({}, _headers("alpha"), _headers("beta"), {"x-tenant": "alpha"}):
        r = httpx.get(url, headers=headers, timeout=30)
        assert r.status_code == 403, (headers, r.text)
        assert "a-private" not in r.text and "loraplex_" not in r.text
    r = httpx.get(url, headers=_headers(raw="Bearer not-a-tenant"), timeout=30)
    assert r.status_code == 401 and "loraplex_" not in r.text
    for headers in (_headers(raw=f"Bearer {ADMIN_TOKEN}"), _headers("ops")):
        r = httpx.get(url, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        assert 'adapter="a-private' in r.text and 'tenant="alpha"' in r.text
    assert 'adapter="a-private' in server.scrape()  # the metrics port: no credential asked
    assert_clean(server)


def test_refused_requests_leave_a_victims_stream_unharmed(env) -> None:
    """Every front-door refusal, on both APIs, over and over beside a victim (the anonymous tenant):
    each gets its exact status, and every victim run makes exactly its tokens alone, none stalled."""
    server, _ = env
    attacks: list[tuple[str, Callable[[], object], object]] = [
        ("two tokens", lambda: _generate(server, _md("alpha") + _md("beta")), grpc.StatusCode.UNAUTHENTICATED),
        ("two tokens", lambda: _complete(server, list(_md("alpha") + _md("beta"))), 401),  # type: ignore[arg-type]
        ("two headers", lambda: _generate(server, (("x-tenant", "alpha"), ("x-tenant", "beta"))),
         grpc.StatusCode.UNAUTHENTICATED),
        ("two headers", lambda: _complete(server, [("x-tenant", "alpha"), ("x-tenant", "beta")]), 401),  # type: ignore[arg-type]
        ("header without opt-in", lambda: _generate(server, (("x-tenant", "limited"),)),
         grpc.StatusCode.UNAUTHENTICATED),
        ("header without opt-in", lambda: _complete(server, {"x-tenant": "limited"}), 401),
        ("bad token", lambda: _generate(server, _md(raw="Bearer nope")), grpc.StatusCode.UNAUTHENTICATED),
        ("bad token", lambda: _complete(server, _headers(raw="Bearer nope")), 401),
        ("n above the cap", lambda: _generate_n(server, _md("sampler"), 4), grpc.StatusCode.INVALID_ARGUMENT),
        ("n above the cap", lambda: _completion(server, _headers("sampler"), n=4), 400),
        ("suspended", lambda: _generate(server, _md("suspended")), grpc.StatusCode.PERMISSION_DENIED),
        ("suspended", lambda: _complete(server, _headers("suspended")), 403),
        ("metrics", lambda: httpx.get(server.http_url + "/metrics", headers=_headers("alpha"), timeout=30), 403),
    ]

    def outcome(call: Callable[[], object]) -> object:
        time.sleep(0.05)  # an attacker, not a CPU hog: the attacking client shares the 2-core box
        try:
            result = call()
        except grpc.RpcError as e:
            return e.code()
        return result.status_code if isinstance(result, httpx.Response) else "OK"

    base = solo_run(server, max_new_tokens=384)  # long enough that one scheduling hiccup is no stall
    seen: list[tuple[str, object, object]] = []
    with victim_beside(server, base):
        for _ in range(3):
            for name, call, expected in attacks:
                seen.append((name, outcome(call), expected))
    assert [(name, got) for name, got, expected in seen if got != expected] == []


@pytest.fixture(scope="module")
def strict(tmp_path_factory) -> Iterator[InferenceServer]:
    """A server with a tenants file that declares no anonymous tenant, no --trusted-tenant-header, no
    --prefix-cache-scope (the default under test), and 2 tenants with their own metric label."""
    tmp = tmp_path_factory.mktemp("strict")
    server = start_inference_server(["--tenants-file", str(_tenants_file(tmp, anonymous=False)),
                                     "--tenant-metrics-top-k", "2"],
                                    env={"LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN}, log_dir=tmp, http=True)
    try:
        yield server
    finally:
        server.stop()


def test_without_a_declared_anonymous_tenant_no_credential_is_refused(strict) -> None:
    """No credential is no tenant: 401 / UNAUTHENTICATED on every tenant route of both APIs
    (/metrics on the API port too); a tenant header is no credential on a server that trusts none."""
    for md, why in (((), "nothing"), ((("x-tenant", "alpha"),), "an untrusted header")):
        _refused_everywhere(strict, md, why)
    assert httpx.get(strict.http_url + "/metrics", timeout=30).status_code == 401
    with InferenceClient(strict.address) as c:
        assert _code(lambda: c.stub.UnloadAdapter(pb.UnloadAdapterRequest(name="x"), timeout=30))[0] == \
            grpc.StatusCode.UNAUTHENTICATED
    assert httpx.get(strict.http_url + "/health", timeout=30).status_code == 200  # probes need no tenant
    assert _complete(strict, _headers("alpha")).status_code == 200
    assert_clean(strict)


def test_prefix_cache_is_per_tenant_by_default(strict) -> None:
    """With a tenants file and no --prefix-cache-scope, a tenant's cached_tokens never reveal another's
    prompt, on either API (another tenant's identical prompt: 0 cached tokens, so its time to first
    token has no cached prefix to give away either), each tenant hits its own, and tenants the
    operator put in one cache_group (rated, teammate) share. The scope is in the log."""
    assert "prefix cache scope: identity (tenants configured: per tenant)" in strict.log()

    def http_cached(tenant: str, prompt: str) -> int:
        r = _complete(strict, _headers(tenant), prompt=prompt)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def grpc_cached(tenant: str, prompt: str) -> int:
        return _generate(strict, _md(tenant), prompt=prompt)[-1].usage.cached_tokens

    for cached, api in ((http_cached, "HTTP"), (grpc_cached, "gRPC")):
        prompt = f"The same system prompt, sent by two tenants of one service over {api}."
        full = (len(prompt.encode()) - 1) // 16 * 16
        assert full >= 32
        assert cached("alpha", prompt) == 0
        assert cached("beta", prompt) == 0, api  # alpha's blocks are cached, under another tenant
        assert cached("alpha", prompt) == full and cached("beta", prompt) == full
        group_prompt = f"A prompt of the team's cache group, over {api}, long enough for blocks."
        assert cached("rated", group_prompt) == 0
        assert cached("teammate", group_prompt) == (len(group_prompt.encode()) - 1) // 16 * 16
        assert cached("alpha", group_prompt) == 0, api
    assert_clean(strict)


def test_no_credential_and_cache_probes_leave_a_victims_stream_unharmed(strict) -> None:
    """Beside a victim tenant (beta, its token) streaming its prompt again and again: requests with
    no credential or an untrusted header are 401 / UNAUTHENTICATED on both APIs, and another tenant
    (alpha) sending the victim's very prompt finds none of it cached (0 cached tokens on both APIs),
    while every victim run makes exactly its tokens alone, none stalled."""
    base = solo_run(strict, max_new_tokens=384, token=TOKENS["beta"])
    seen: list[tuple[str, object]] = []

    def status(call: Callable[[], object]) -> object:
        time.sleep(0.05)  # an attacker, not a CPU hog: the attacking client shares the 2-core box
        try:
            result = call()
        except grpc.RpcError as e:
            return e.code()
        return result.status_code if isinstance(result, httpx.Response) else "OK"

    with victim_beside(strict, base):
        # alpha's first sending of the prompt on each API (later ones would hit alpha's own blocks)
        r = _complete(strict, _headers("alpha"), prompt=VICTIM_PROMPT)
        seen.append(("http probe", r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]))
        seen.append(("grpc probe", _generate(strict, _md("alpha"), prompt=VICTIM_PROMPT)[-1].usage.cached_tokens))
        for _ in range(3):
            seen += [("grpc none", status(lambda: _generate(strict, ()))),
                     ("http none", status(lambda: _complete(strict, {}))),
                     ("grpc header", status(lambda: _generate(strict, (("x-tenant", "beta"),)))),
                     ("http header", status(lambda: _complete(strict, {"x-tenant": "beta"}))),
                     ("metrics", status(lambda: httpx.get(strict.http_url + "/metrics", timeout=30)))]
    expected = {"grpc none": grpc.StatusCode.UNAUTHENTICATED, "http none": 401,
                "grpc header": grpc.StatusCode.UNAUTHENTICATED, "http header": 401, "metrics": 401,
                "http probe": 0, "grpc probe": 0}
    assert [(what, got) for what, got in seen if got != expected[what]] == []
    assert _generate(strict, _md("beta"), prompt=VICTIM_PROMPT)[-1].usage.cached_tokens == 16  # beta's own: a hit
    assert_clean(strict)


def test_tenant_labels_are_bounded_by_top_k(strict) -> None:
    """More principals than --tenant-metrics-top-k (2 here): exactly the two with the most tokens
    keep their label and every other principal is summed as `other`, on every per-tenant series."""
    for tenant, tokens in (("alpha", 60), ("beta", 50), ("limited", 3), ("sampler", 2), ("ops", 1)):
        r = _complete(strict, _headers(tenant), max_tokens=tokens)
        assert r.status_code == 200, r.text
    generated = _tenant_samples(strict, "loraplex_tenant_generated_tokens_total")
    assert set(generated) == {("alpha",), ("beta",), ("other",)}, generated
    total = sum(generated.values())
    assert generated[("other",)] == total - generated[("alpha",)] - generated[("beta",)] >= 6
    for name in ("loraplex_tenant_requests_running", "loraplex_tenant_requests_waiting"):
        assert set(_tenant_samples(strict, name)) == {("alpha",), ("beta",), ("other",)}, name
    refusals = _tenant_samples(strict, "loraplex_tenant_quota_refusals_total")
    assert {tenant for _, tenant in refusals} == {"alpha", "beta", "other"}, refusals


def test_priority_within_what_the_tenant_may_ask(env) -> None:
    """A per-request priority (vLLM's: lower first) on both APIs; below the tenant's min_priority (0
    unless its entry says otherwise; admins: any) is INVALID_ARGUMENT / 400 naming the field."""
    server, _ = env

    def grpc_priority(md, priority: int) -> pb.GenerateResponse:  # type: ignore[no-untyped-def]
        with InferenceClient(server.address) as c:
            req = c.request("hello", max_new_tokens=2, ignore_eos=True)
            req.priority = priority
            return list(c.stub.Generate(req, metadata=md, timeout=60))[-1]

    def http_priority(headers: dict[str, str], priority: object) -> httpx.Response:
        return httpx.post(server.http_url + "/v1/completions", headers=headers, timeout=60,
                          json={"model": BASE, "prompt": "hello", "max_tokens": 2, "priority": priority})

    assert grpc_priority(_md("alpha"), 7).finish_reason == pb.FINISH_REASON_LENGTH
    assert grpc_priority(_md("beta"), -5).finish_reason == pb.FINISH_REASON_LENGTH
    assert grpc_priority(_md("ops"), -1000).finish_reason == pb.FINISH_REASON_LENGTH
    for md, priority in ((_md("alpha"), -1), ((), -1), (_md("beta"), -6)):
        assert _code(lambda md=md, p=priority: grpc_priority(md, p))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert http_priority(_headers("alpha"), 3).status_code == 200
    assert http_priority(_headers("beta"), -5).status_code == 200
    for headers, priority in ((_headers("alpha"), -1), ({}, -2), (_headers("beta"), -6), (_headers("ops"), 2**31),
                              (_headers("alpha"), "high")):
        r = http_priority(headers, priority)
        assert r.status_code == 400, (priority, r.text)
        assert r.json()["error"]["param"] == "priority", r.text
    assert_clean(server)


@pytest.mark.parametrize("fair", ["on", "off"])
def test_fair_share_and_priority_preempt_a_tenant_filling_the_batch(tmp_path, fair) -> None:
    """Through the real server (--max-num-seqs 2): alpha keeps four long streams going, two running
    and two queued. An urgent request (priority -3) runs to its end while every alpha stream is still
    going (priority preemption, fair share on or off); then so does beta's short one at priority 0
    with fair share on (it preempts one of alpha's seats), while with it off it waits behind alpha's
    queued requests: the control that shows the check would fail without fair share. Every gauge is
    back at zero after."""
    server = start_inference_server(["--tenants-file", str(_tenants_file(tmp_path)), "--max-num-seqs", "2",
                                     "--fair-share", fair, "--max-new-tokens-limit", "1000"],
                                    log_dir=tmp_path, http=True)
    done: list[str] = []
    first_tokens = threading.Semaphore(0)

    def heavy(i: int) -> None:
        body = {"model": BASE, "prompt": f"heavy {i}", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.http_url + "/v1/completions", headers=_headers("alpha"), json=body,
                          timeout=120) as r:
            assert r.status_code == 200
            for j, _ in enumerate(r.iter_lines()):
                if j == 0:
                    first_tokens.release()
        done.append(f"heavy {i}")

    try:
        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(heavy, i) for i in range(4)]
            for _ in range(2):
                assert first_tokens.acquire(timeout=60)
            with InferenceClient(server.address) as c:
                urgent = c.request("urgent", max_new_tokens=4, ignore_eos=True)
                urgent.priority = -3
                last = list(c.stub.Generate(urgent, metadata=_md("beta"), timeout=60))[-1]
            assert last.finish_reason == pb.FINISH_REASON_LENGTH
            urgent_before = list(done)
            light = _complete(server, _headers("beta"), max_tokens=4)
            assert light.status_code == 200, light.text
            light_before = list(done)
            for stream in streams:
                stream.result(timeout=300)
        preemptions = {dict(labels)["cause"]: v for (n, labels), v in server.samples().items()
                       if n == "loraplex_preemptions_total"}
        if fair == "on":
            assert light_before == [] and preemptions["fair_share"] >= 1, (light_before, preemptions)
        else:
            assert light_before and preemptions["fair_share"] == 0, (light_before, preemptions)
        assert urgent_before == [] and preemptions["priority"] >= 1, (urgent_before, preemptions)
        assert_clean(server)
    finally:
        server.stop()


# ---- units ----------------------------------------------------------------------------------------

def test_tenants_file_is_checked() -> None:
    good = {"tenants": [{"name": "t", "token_sha256": _sha("x"), "max_running": 2, "weight": 2, "cache_group": "g",
                         "via_trusted_header": True},
                        {"name": "anonymous", "anonymous": True, "max_running": 1}]}
    spec, anonymous = parse_tenants(good)
    assert spec.max_in_flight == 2 and spec.weight == 2.0 and spec.token_sha256 == hashlib.sha256(b"x").digest()
    assert spec.cache_group == "g" and spec.via_trusted_header and not spec.anonymous
    assert anonymous.anonymous and anonymous.max_in_flight == 1
    for bad in ({"tenants": [{"name": "other"}]}, {"tenants": [{"name": "t", "token": "plain"}]},
                {"tenants": [{"name": "t", "token_sha256": "zz"}]}, {"tenants": [{"name": "t", "max_running": -1}]},
                {"tenants": [{"name": "t"}, {"name": "t"}]}, {"users": []},
                {"tenants": [{"name": "a", "token_sha256": _sha("x")}, {"name": "b", "token_sha256": _sha("x")}]},
                {"tenants": [{"name": "anonymous"}]},  # the anonymous tenant is declared, never implied
                {"tenants": [{"name": "guest", "anonymous": True}]},
                {"tenants": [{"name": "anonymous", "anonymous": True, "token_sha256": _sha("x")}]},
                {"tenants": [{"name": "anonymous", "anonymous": True, "via_trusted_header": True}]},
                {"tenants": [{"name": "anonymous", "anonymous": "yes"}]},
                {"tenants": [{"name": "t", "via_trusted_header": "true"}]},
                {"tenants": [{"name": "t", "cache_group": ""}]}, {"tenants": [{"name": "t", "cache_group": 3}]}):
        with pytest.raises(ValueError):
            parse_tenants(bad)


def test_identity_rules() -> None:
    """No credential: UNAUTHENTICATED with any tenant configuration unless an anonymous tenant is
    declared (then it, with its limits); without any configuration, the one unlimited anonymous
    tenant. A header names only opted-in tenants, never as admins; a token decides over a header;
    a repeated Authorization or header is refused."""
    alpha = TenantSpec("alpha", token_sha256=hashlib.sha256(b"a-token").digest(), via_trusted_header=True)
    plain = TenantSpec("plain", token_sha256=hashlib.sha256(b"p-token").digest(), admin=True)
    guest = TenantSpec(ANONYMOUS, max_running=1, anonymous=True)
    assert Tenancy().resolve((), None).name == ANONYMOUS and Tenancy().resolve((), None).spec is None
    for strict in (Tenancy((alpha,)), Tenancy(trusted_header="x-tenant"), Tenancy(mtls=True),
                   Tenancy((alpha,), "adm")):
        with pytest.raises(UnauthenticatedError):
            strict.resolve((), None)
    assert Tenancy((alpha, guest)).resolve((), None).spec == guest
    tenancy = Tenancy((alpha, plain, guest), "adm", trusted_header="X-Tenant")
    assert tenancy.resolve((("x-tenant", "alpha"),), None).name == "alpha"
    for name in ("plain", "admin", "anonymous", "other", "nobody", ""):
        with pytest.raises(UnauthenticatedError):
            tenancy.resolve((("x-tenant", name),), None)
    assert tenancy.resolve((("authorization", "Bearer p-token"), ("x-tenant", "alpha")), None).name == "plain"
    assert tenancy.resolve((("x-tenant", "alpha"), ("authorization", "Bearer adm")), None).admin
    for repeated in ((("authorization", "Bearer a-token"), ("Authorization", "Bearer a-token")),
                     (("x-tenant", "alpha"), ("X-Tenant", "alpha"))):
        with pytest.raises(UnauthenticatedError):
            tenancy.resolve(repeated, None)
    assert Tenancy((plain,)).resolve((), "plain").admin  # an mTLS identity the CA vouched for may be


def test_quota_checks_count_samples_and_refuse_what_never_fits() -> None:
    tenancy = Tenancy((TenantSpec("t", max_running=2, max_queued=1, tokens_per_minute=1000),
                       TenantSpec("off", max_running=0, max_queued=0)))
    tenant, off = tenancy._named("t"), tenancy._named("off")
    held = tenancy.admit(tenant, 2, 10, 10)
    with pytest.raises(QuotaExceeded):  # 2 + 2 > 3: retryable
        tenancy.admit(tenant, 2, 10, 10)
    tenancy.admit(tenant, 1, 10, 10).release(0)
    for samples, max_new in ((4, 10), (1, 1000)):  # above the cap, above the whole rate: never fits
        with pytest.raises(InvalidArgumentError):
            tenancy.admit(tenant, samples, 10, max_new)
    for check in (lambda: tenancy.check_in_flight(off), lambda: tenancy.admit(off, 1, 1, 1)):
        with pytest.raises(PermissionDeniedError):
            check()
    held.release(20)
    assert tenancy.in_flight() == {"t": (0, 0)}


def test_token_bucket_refills_and_refunds() -> None:
    now = [100.0]
    tenancy = Tenancy((TenantSpec("t", tokens_per_minute=600),), clock=lambda: now[0])
    tenant = tenancy._named("t")
    ticket = tenancy.admit(tenant, 1, 100, 400)  # 500 of 600
    with pytest.raises(QuotaExceeded) as e:
        tenancy.admit(tenant, 1, 100, 400)
    assert e.value.retry_after_s == pytest.approx(40.0)  # 400 short at 10 tokens/s
    ticket.release(50)  # 350 unused tokens come back: 450
    with pytest.raises(QuotaExceeded):
        tenancy.admit(tenant, 1, 100, 400)
    tenancy.admit(tenant, 1, 100, 300).release(300)  # 50 left
    assert tenancy.in_flight() == {"t": (0, 0)}
    now[0] += 60
    tenancy.admit(tenant, 1, 100, 500).release(0)
