"""A tenant's adapters are its own: names, sources, registry places, and they survive a restart.

Real servers in subprocesses, both front ends. Every attack has its exact status code on gRPC and
HTTP, a victim tenant streams on its own adapter beside it with the tokens it gets alone, and the
server is clean afterwards (harness/isolation.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest

from harness.inference_server import ROOT, InferenceServer, start_inference_server
from harness.isolation import assert_clean, solo_run, victim_beside
from inference_service.api import inference_pb2 as pb
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter
from inference_service.frontend.namespace import engine_name

pytestmark = pytest.mark.slow
ADMIN_TOKEN = "operator-admin-token"
TOKENS = {"alice": "alice-token", "bob": "bob-token", "carol": "carol-token", "dave": "dave-token"}
MAX_ALICE = 3  # alice's max_adapters
MAX_REGISTERED = 6  # the server's --max-registered-adapters


def _tenants_file(tmp: Path, root: Path) -> Path:
    def entry(name: str, **extra: object) -> dict[str, object]:
        return {"name": name, "token_sha256": hashlib.sha256(TOKENS[name].encode()).hexdigest(), **extra}

    data = {"tenants": [
        entry("alice", sources=[(root / "alice").as_uri()], max_adapters=MAX_ALICE),
        entry("bob", sources=[(root / "bob").as_uri()], max_adapters=3),
        entry("carol", sources=[(root / "carol").as_uri()], max_adapters=3),
        entry("dave"),  # no sources: may load nothing
    ]}
    path = tmp / "tenants.json"
    path.write_text(json.dumps(data))
    return path


def _adapters(root: Path) -> None:
    """Each tenant's directory; alice/link points into bob's (a link must not carry her out)."""
    for i, rel in enumerate(("alice/foo", "alice/secret", "alice/x1", "alice/x2", "bob/foo", "bobby/foo",
                             "carol/c1", "shared/common", "alice/common")):
        write_peft_adapter(root / rel, rank=4, seed=60 + i)
    os.symlink(root / "bob" / "foo", root / "alice" / "link")


def _server(tmp: Path, root: Path, state_dir: Path | None = None) -> InferenceServer:
    return start_inference_server(
        ["--tenants-file", str(_tenants_file(tmp, root)), "--adapter-source-allow", root.as_uri(),
         "--max-registered-adapters", str(MAX_REGISTERED),
         *(["--state-dir", str(state_dir)] if state_dir else [])],
        env={"LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN}, log_dir=tmp, http=True)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[tuple[InferenceServer, Path]]:
    tmp = tmp_path_factory.mktemp("tenant-adapters")
    root = tmp / "adapters"
    _adapters(root)
    server = _server(tmp, root)
    try:
        _load(server, "bob", "foo", root / "bob" / "foo")  # bob's foo: the victim's adapter
        _load(server, "alice", "foo", root / "alice" / "foo")  # alice's foo: same name, other weights
        _load(server, "alice", "secret", root / "alice" / "secret")
        with InferenceClient(server.address, token=ADMIN_TOKEN) as admin:
            admin.load_adapter("common", (root / "shared" / "common").as_uri(), shared=True, timeout=60)
        yield server, root
    finally:
        server.stop()


def _md(who: str) -> tuple[tuple[str, str], ...]:
    token = ADMIN_TOKEN if who == "admin" else TOKENS[who]
    return (("authorization", f"Bearer {token}"),)


def _h(who: str) -> dict[str, str]:
    return dict(_md(who))


def _load(server: InferenceServer, who: str, name: str, path: Path | str, **kw: object) -> pb.Adapter:
    uri = path if isinstance(path, str) else path.as_uri()
    with InferenceClient(server.address, token=TOKENS[who] if who != "admin" else ADMIN_TOKEN) as c:
        return c.load_adapter(name, uri, timeout=60, **kw)  # type: ignore[arg-type]


def _http_load(server: InferenceServer, who: str, name: str, path: str, **extra: object) -> httpx.Response:
    return httpx.post(server.http_url + "/v1/load_lora_adapter", headers=_h(who), timeout=60,
                      json={"lora_name": name, "lora_path": path, **extra})


def _unload(server: InferenceServer, who: str, name: str) -> None:
    with InferenceClient(server.address) as c:
        c.stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), metadata=_md(who), timeout=30)


def _http_unload(server: InferenceServer, who: str, name: str) -> httpx.Response:
    return httpx.post(server.http_url + "/v1/unload_lora_adapter", headers=_h(who), timeout=30,
                      json={"lora_name": name})


def _tokens(server: InferenceServer, who: str, adapter: str, prompt: str = "one two three") -> list[int]:
    with InferenceClient(server.address) as c:
        req = c.request(prompt, adapter=adapter, max_new_tokens=8, ignore_eos=True)
        return [t for r in c.stub.Generate(req, metadata=_md(who), timeout=60) for t in r.token_ids]


def _http_tokens(server: InferenceServer, who: str, model: str) -> httpx.Response:
    return httpx.post(server.http_url + "/v1/completions", headers=_h(who), timeout=60,
                      json={"model": model, "prompt": "one two three", "max_tokens": 8, "ignore_eos": True})


def _code(fn: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details()
    raise AssertionError("the call succeeded")


def _list(server: InferenceServer, who: str) -> list[str]:
    with InferenceClient(server.address) as c:
        return [a.name for a in c.stub.ListAdapters(pb.ListAdaptersRequest(), metadata=_md(who), timeout=30).adapters]


def _models(server: InferenceServer, who: str) -> set[str]:
    r = httpx.get(server.http_url + "/v1/models", headers=_h(who), timeout=30)
    assert r.status_code == 200, r.text
    return {m["id"] for m in r.json()["data"]} - {"builtin:tiny"}


def _refusals(server: InferenceServer, tenant: str, reason: str) -> float:
    return server.value("loraplex_tenant_adapter_refusals_total", tenant=tenant, reason=reason)


def test_two_tenants_each_have_their_own_foo(env) -> None:
    """alice's foo and bob's foo are two adapters: each tenant gets its own weights' tokens (the ones the
    admin gets by the engine name), and sees its own and the shared adapters, by bare name."""
    server, _ = env
    alice, bob = _tokens(server, "alice", "foo"), _tokens(server, "bob", "foo")
    assert alice == _tokens(server, "admin", engine_name("alice", "foo"))
    assert bob == _tokens(server, "admin", engine_name("bob", "foo"))
    assert alice != bob  # other weights (a collision here would make the test blind)
    for who in ("alice", "bob"):
        r = _http_tokens(server, who, "foo")
        assert r.status_code == 200, r.text
    assert sorted(_list(server, "alice")) == ["common", "foo", "secret"]
    assert sorted(_list(server, "bob")) == ["common", "foo"]
    assert sorted(_list(server, "carol")) == ["common"]
    assert _models(server, "alice") == {"common", "foo", "secret"}
    assert _models(server, "bob") == {"common", "foo"}
    assert set(_list(server, "admin")) >= {"common", engine_name("alice", "foo"), engine_name("bob", "foo"),
                                           engine_name("alice", "secret")}
    # one adapter a page: bob's pages and their tokens hold his and the shared names only
    with InferenceClient(server.address) as c:
        seen, token = [], ""
        while True:
            page = c.stub.ListAdapters(pb.ListAdaptersRequest(page_size=1, page_token=token), metadata=_md("bob"),
                                       timeout=30)
            seen += [a.name for a in page.adapters]
            token = page.next_page_token
            if not token:
                break
            assert token.rpartition("@")[0] in ("common", "foo"), token
    assert seen == ["common", "foo"]
    assert_clean(server)


def test_another_tenants_adapter_is_exactly_an_unknown_name(env) -> None:
    """Whatever bob does with alice's `secret` (generate, tokenize, unload, list, load over it), the
    answer is the one for a name nobody has, word for word, on both front ends; a name of the engine's
    tenant form is INVALID_ARGUMENT whether it exists or not."""
    server, root = env

    def same(code_a: tuple[grpc.StatusCode, str], code_b: tuple[grpc.StatusCode, str]) -> None:
        assert (code_a[0], code_a[1].replace("secret", "nobody-has")) == code_b

    base = solo_run(server, adapter="secret", max_new_tokens=32, token=TOKENS["alice"])
    with victim_beside(server, base):  # alice streams on her secret while the others probe for it
        _probe(server, root, same)
    # alice's adapter is untouched by all of it
    assert _tokens(server, "alice", "secret") == _tokens(server, "admin", engine_name("alice", "secret"))
    assert "secret" in _list(server, "alice")


def _probe(server: InferenceServer, root: Path,
           same: Callable[[tuple[grpc.StatusCode, str], tuple[grpc.StatusCode, str]], None]) -> None:
    for who in ("bob", "carol", "dave"):
        same(_code(lambda who=who: _tokens(server, who, "secret")),
             _code(lambda who=who: _tokens(server, who, "nobody-has")))
        same(_code(lambda who=who: _unload(server, who, "secret")),
             _code(lambda who=who: _unload(server, who, "nobody-has")))
        for call in (lambda m, who=who: _http_tokens(server, who, m),
                     lambda m, who=who: _http_unload(server, who, m),
                     lambda m, who=who: httpx.post(server.http_url + "/tokenize", headers=_h(who), timeout=30,
                                                   json={"model": m, "prompt": "x"})):
            hidden, unknown = call("secret"), call("nobody-has")
            assert hidden.status_code == unknown.status_code == 404, hidden.text
            assert hidden.text.replace("secret", "nobody-has") == unknown.text
    assert _code(lambda: _tokens(server, "bob", "nobody-has"))[0] == grpc.StatusCode.NOT_FOUND
    # The engine name of alice's adapter, and one of the same form that exists nowhere: the same refusal.
    real = engine_name("alice", "secret")
    fake = "secret__" + "0" * 32
    answers = []
    for name in (real, fake):
        code, details = _code(lambda name=name: _tokens(server, "bob", name))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        r = _http_tokens(server, "bob", name)
        assert r.status_code == 400
        answers.append((details.replace(name, "NAME"), r.text.replace(name, "NAME")))
        assert _code(lambda name=name: _unload(server, "bob", name))[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert _http_unload(server, "bob", name).status_code == 400
        assert _code(lambda name=name: _load(server, "bob", name, root / "bob" / "foo"))[0] == \
            grpc.StatusCode.INVALID_ARGUMENT
    assert answers[0] == answers[1]


def test_a_tenants_own_name_shadows_the_shared_one(env) -> None:
    """alice loads her own `common`: she gets hers, everyone else the shared one; unloading hers gives
    her the shared one back. A tenant cannot unload the shared one (PERMISSION_DENIED / 403: it sees it)."""
    server, root = env
    shared = _tokens(server, "bob", "common")
    _load(server, "alice", "common", root / "alice" / "common")
    try:
        assert _tokens(server, "alice", "common") == _tokens(server, "admin", engine_name("alice", "common"))
        assert _tokens(server, "alice", "common") != shared
        assert _tokens(server, "bob", "common") == shared
        assert _list(server, "alice").count("common") == 1
        assert _models(server, "bob") == {"common", "foo"}
    finally:
        _unload(server, "alice", "common")
    assert _tokens(server, "alice", "common") == shared
    assert _code(lambda: _unload(server, "bob", "common"))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert _http_unload(server, "bob", "common").status_code == 403
    assert _tokens(server, "bob", "common") == shared
    assert_clean(server)


def test_only_an_admin_loads_shared_adapters_or_into_a_tenants_namespace(env) -> None:
    server, root = env
    path = root / "carol" / "c1"
    assert _code(lambda: _load(server, "carol", "c1", path, shared=True))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert _code(lambda: _load(server, "carol", "c1", path, tenant="bob"))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert _http_load(server, "carol", "c1", str(path), shared=True).status_code == 403
    assert _http_load(server, "carol", "c1", str(path), tenant="bob").status_code == 403
    assert "c1" not in _list(server, "carol") + _list(server, "bob")
    # the admin loads it for carol: carol's by bare name, nobody else's
    r = _http_load(server, "admin", "c1", str(path), tenant="carol")
    assert r.status_code == 200, r.text
    try:
        assert "c1" in _list(server, "carol") and "c1" not in _list(server, "bob")
        assert len(_tokens(server, "carol", "c1")) == 8
        assert _code(lambda: _tokens(server, "bob", "c1"))[0] == grpc.StatusCode.NOT_FOUND
    finally:
        _unload(server, "admin", engine_name("carol", "c1"))  # an admin addresses any adapter by engine name
    assert "c1" not in _list(server, "carol")
    assert_clean(server)


SOURCE_ATTACKS = {  # what alice tries to load, relative to the adapters root, and why it must fail
    "bob/foo": "another tenant's directory (under the operator's allow-list)",
    "alice/link": "a link in her directory to bob's",
    "alice/../bob/foo": "a '..' segment",
    "alice/%2e%2e/bob/foo": "a percent-encoded '..'",
    "bobby/foo": "bob's sibling (for bob's prefix): here outside alice's",
}


def test_a_tenant_loads_only_from_its_own_sources(env) -> None:
    """alice cannot load bob's weights under her name, by any path trick; bob cannot load from
    `bobby` (a prefix of his name is no prefix of his directory); dave has no sources at all. Every
    refusal is PERMISSION_DENIED / 403, counted, and bob's stream on his foo is unharmed throughout."""
    server, root = env
    base = solo_run(server, adapter="foo", max_new_tokens=32, token=TOKENS["bob"])
    before = {t: _refusals(server, t, "source") for t in ("alice", "bob", "dave")}
    names_before = sorted(_list(server, "alice"))
    with victim_beside(server, base):
        for rel, why in SOURCE_ATTACKS.items():
            uri = root.as_uri() + "/" + rel
            assert _code(lambda uri=uri: _load(server, "alice", "stolen", uri))[0] == \
                grpc.StatusCode.PERMISSION_DENIED, why
            r = _http_load(server, "alice", "stolen", uri)
            assert r.status_code == 403, (why, r.text)
            # her own sources, never the operator's allow-list (which may name other tenants' prefixes)
            assert r.json()["error"]["message"].endswith(
                f"is outside this tenant's sources ({(root / 'alice').as_uri()}; the tenants file's `sources`)"), why
        path = str(root / "bob" / "foo")  # HTTP takes a plain path too
        assert _http_load(server, "alice", "stolen", path).status_code == 403
        assert _code(lambda: _load(server, "bob", "sibling", root / "bobby" / "foo"))[0] == \
            grpc.StatusCode.PERMISSION_DENIED
        assert _http_load(server, "bob", "sibling", str(root / "bobby" / "foo")).status_code == 403
        assert _code(lambda: _load(server, "dave", "any", root / "alice" / "foo"))[0] == \
            grpc.StatusCode.PERMISSION_DENIED
        assert _http_load(server, "dave", "any", str(root / "alice" / "foo")).status_code == 403
    assert _refusals(server, "alice", "source") == before["alice"] + 2 * len(SOURCE_ATTACKS) + 1
    assert _refusals(server, "bob", "source") == before["bob"] + 2
    assert _refusals(server, "dave", "source") == before["dave"] + 2
    assert sorted(_list(server, "alice")) == names_before  # nothing registered
    assert _tokens(server, "bob", "foo") == _tokens(server, "admin", engine_name("bob", "foo"))


def test_a_tenant_cannot_fill_the_registry(env) -> None:
    """alice at her max_adapters: a new name is FAILED_PRECONDITION / 400 (she must unload one of hers;
    retrying alone cannot pass), a reload of one she holds passes, carol's own load still passes, and
    after alice unloads one her load passes. bob streams beside it unharmed."""
    server, root = env
    base = solo_run(server, adapter="foo", max_new_tokens=32, token=TOKENS["bob"])
    refused = _refusals(server, "alice", "max_adapters")
    assert sorted(n for n in _list(server, "alice") if n != "common") == ["foo", "secret"]
    _load(server, "alice", "x1", root / "alice" / "x1")  # her third: MAX_ALICE
    try:
        with victim_beside(server, base):
            code, details = _code(lambda: _load(server, "alice", "x2", root / "alice" / "x2"))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "max_adapters" in details, details
            r = _http_load(server, "alice", "x2", str(root / "alice" / "x2"))
            assert r.status_code == 400 and r.json()["error"]["code"] == "FAILED_PRECONDITION", r.text
            _load(server, "alice", "foo", root / "alice" / "foo")  # a reload takes no new place
            _load(server, "carol", "c1", root / "carol" / "c1")  # the registry has room for carol
        assert _refusals(server, "alice", "max_adapters") == refused + 2
        _unload(server, "alice", "x1")
        r = _http_load(server, "alice", "x2", str(root / "alice" / "x2"))
        assert r.status_code == 200, r.text
        assert sorted(n for n in _list(server, "alice") if n != "common") == ["foo", "secret", "x2"]
    finally:
        for who, name in (("carol", "c1"), ("alice", "x1"), ("alice", "x2")):
            if name in _list(server, who):
                _unload(server, who, name)
    assert_clean(server)


def test_a_tenants_adapters_survive_a_restart(tmp_path) -> None:
    """With --state-dir, alice's foo (and the shared common) are registered again after the server
    is killed and started again: alice's model=foo gives the same tokens, bob still gets 404, and an
    adapter alice unloaded before the restart stays gone."""
    root = tmp_path / "adapters"
    _adapters(root)
    state = tmp_path / "state"
    server = _server(tmp_path, root, state)
    try:
        _load(server, "alice", "foo", root / "alice" / "foo")
        r = _http_load(server, "alice", "secret", str(root / "alice" / "secret"))
        assert r.status_code == 200, r.text
        _unload(server, "alice", "secret")
        with InferenceClient(server.address, token=ADMIN_TOKEN) as admin:
            admin.load_adapter("common", (root / "shared" / "common").as_uri(), shared=True, timeout=60)
        before = _tokens(server, "alice", "foo")
        server.proc.kill()  # no drain, no goodbye: what a crash leaves
        server.proc.wait(30)
    finally:
        server.stop()
    server = _server(tmp_path, root, state)
    try:
        assert _tokens(server, "alice", "foo") == before
        r = _http_tokens(server, "alice", "foo")
        assert r.status_code == 200, r.text
        assert sorted(_list(server, "alice")) == ["common", "foo"]
        assert sorted(_list(server, "bob")) == ["common"]
        assert _code(lambda: _tokens(server, "bob", "foo"))[0] == grpc.StatusCode.NOT_FOUND
        assert _http_tokens(server, "bob", "foo").status_code == 404
        assert _code(lambda: _tokens(server, "alice", "secret"))[0] == grpc.StatusCode.NOT_FOUND
        assert_clean(server)
    finally:
        server.stop()


@pytest.mark.parametrize("content", ['{"adapters": [{"uri": 1}]}', "{not json", '{"adapters": 3}'])
def test_a_damaged_state_file_stops_the_start_with_its_path(tmp_path, content: str) -> None:
    """The server does not start half-remembering its tenants' adapters: exit 2 naming the file."""
    (tmp_path / "adapters.json").write_text(content)
    out = subprocess.run([sys.executable, "-m", "inference_service.cli", "--model", "builtin:tiny",
                          "--state-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert str(tmp_path / "adapters.json") in out.stderr and "Traceback" not in out.stderr, out.stderr
