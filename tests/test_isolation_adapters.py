"""Tenant isolation, adapter files and sources: hostile adapters and URIs against a real server
(builtin:tiny, the local no-sidecar source, one server for the module), each beside a victim stream
that must finish unharmed (harness/isolation.py), with the exact status code of the attack and a
clean server afterwards (no leak, SERVING, no traceback in its log). The victim runs on an adapter
resident in a slot, so an attack that reached the slots (an overwritten or evicted slot, a load
that stalls the loader) would show in its tokens or as a pause in its stream.

What each attack did before: a backtracking regex froze the process; "inf" in alpha_pattern reached
the sampler; malformed files came back UNAVAILABLE with a traceback; aliased offsets and
"use_rslora": "false" were accepted; the local source followed links out of its root, served a
directory swapped for a link from its cache, blocked its loader threads on a FIFO, and took any path
without an allow-list.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from adapter_cache.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from harness.bad_adapters import (
    alias_offsets,
    config_bytes,
    edit_config,
    edit_header,
    first_tensor,
    good_config_text,
    overlap_offsets,
    q_in,
    write_adapter,
)
from harness.inference_server import InferenceServer, start_inference_server
from harness.isolation import VictimResult, resident_adapter, solo_run, status_of, victim_beside
from inference_service.client import InferenceClient

VICTIM_TOKENS = 384  # ~0.4 s alone on an idle 2-core box: longer than any attack here, long enough to even out jitter
INVALID, DENIED, OK = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OK
CATASTROPHIC = "(.+.+)+Z"  # exponential for a backtracking matcher on a 30-character module path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(the allowed root holding a good adapter, a directory outside it holding another)."""
    root, outside = tmp_path_factory.mktemp("allowed"), tmp_path_factory.mktemp("outside")
    write_adapter(root / "good")
    write_adapter(outside / "secret")
    return root, outside


@pytest.fixture(scope="module")
def server(dirs, tmp_path_factory) -> Iterator[InferenceServer]:
    root, _ = dirs
    s = start_inference_server(["--model", "builtin:tiny", "--max-loras", "2", "--adapter-source-allow", root.as_uri()],
                               log_dir=tmp_path_factory.mktemp("server-log"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def base(server, dirs) -> VictimResult:
    resident_adapter(server, "victim", (dirs[0] / "good").as_uri())
    return solo_run(server, adapter="victim", max_new_tokens=VICTIM_TOKENS)


@pytest.fixture(scope="module")
def client(server) -> Iterator[InferenceClient]:
    with InferenceClient(server.address) as c:
        yield c


def load_status(client: InferenceClient, name: str, uri: str) -> grpc.StatusCode:
    """LoadAdapter's status code (OK, after which the adapter is unloaded again)."""
    try:
        client.load_adapter(name, uri, timeout=60)
    except grpc.RpcError as e:
        assert e.details(), "an error without a message"
        return e.code()
    client.unload_adapter(name, timeout=60)
    return OK


def fresh(root: Path, name: str) -> Path:
    """A path under `root` that nothing has used yet (the module's tests share its directories)."""
    for n in itertools.count():
        path = root / (name if n == 0 else f"{name}-{n}")
        if not path.exists() and not path.is_symlink():
            return path
    raise AssertionError("unreachable")


def bad_copy(root: Path, case_id: str, edit: Callable[[Path], None]) -> Path:
    path = fresh(root, case_id)
    shutil.copytree(root / "good", path)
    edit(path)
    return path


CASES = [
    # RE2 runs the regexes in linear time: a backtracking-bomb pattern is harmless, and loads where
    # it names a module
    ("target-modules-catastrophic", edit_config(target_modules=CATASTROPHIC), INVALID),
    ("target-modules-catastrophic-or-q_proj", edit_config(target_modules=f"{CATASTROPHIC}|q_proj|v_proj|down_proj"),
     OK),
    ("alpha-pattern-catastrophic-key", edit_config(alpha_pattern={CATASTROPHIC: 16}), OK),
    ("alpha-pattern-invalid-regex", edit_config(alpha_pattern={"q_proj(": 16}), INVALID),
    ("alpha-pattern-inf-string", edit_config(alpha_pattern={"q_proj": "inf"}), INVALID),
    ("rank-pattern-non-int", edit_config(rank_pattern={"q_proj": 2.5}), INVALID),
    ("use_rslora-string-false", edit_config(use_rslora="false"), INVALID),
    ("config-deeply-nested", config_bytes(good_config_text(extra="[" * 100_000 + "]" * 100_000)), INVALID),
    ("config-5000-digit-int", config_bytes(good_config_text(lora_alpha="9" * 5000)), INVALID),
    ("shape-negative-dims", edit_header(lambda h: first_tensor(h).update(shape=[-4, -q_in])), INVALID),
    ("shape-zero-dim", edit_header(lambda h: first_tensor(h).update(shape=[0, q_in], data_offsets=[0, 0])), INVALID),
    ("dtype-a-list", edit_header(lambda h: first_tensor(h).update(dtype=["F32"])), INVALID),
    ("offsets-aliased", edit_header(alias_offsets), INVALID),
    ("offsets-overlapping", edit_header(overlap_offsets), INVALID),
]


@pytest.mark.parametrize("case_id, edit, code", CASES, ids=[c[0] for c in CASES])
def test_hostile_adapter_file(server, base, client, dirs, case_id, edit, code):
    path = bad_copy(dirs[0], case_id, edit)
    with victim_beside(server, base):
        assert load_status(client, case_id, path.as_uri()) == code


def test_symlinks_escaping_the_root(server, base, client, dirs):
    root, outside = dirs
    dir_link, file_links = fresh(root, "dir-link"), fresh(root, "file-links")
    dir_link.symlink_to(outside / "secret")
    file_links.mkdir()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        (file_links / name).symlink_to(outside / "secret" / name)
    with victim_beside(server, base):
        assert load_status(client, dir_link.name, dir_link.as_uri()) == DENIED  # at the URI check
        assert load_status(client, file_links.name, file_links.as_uri()) == DENIED  # at open time
    assert "peft_type" not in server.log()  # no file content echoed


def test_a_directory_swapped_for_a_symlink_after_load_adapter(server, base, client, dirs):
    root, outside = dirs
    swapped = fresh(root, "swapped")
    shutil.copytree(root / "good", swapped)
    client.load_adapter(swapped.name, swapped.as_uri(), timeout=60)  # registered: no slot, no host copy
    shutil.rmtree(swapped)
    swapped.symlink_to(outside / "secret")
    with victim_beside(server, base):
        # The request needs the adapter in a slot: the fetch re-checks the files and refuses them.
        code = status_of(lambda: list(client.generate("x", adapter=swapped.name, max_new_tokens=4, timeout=60)))
        assert code == DENIED
    client.unload_adapter(swapped.name, timeout=60)


def test_a_fifo_as_the_weights_file_and_other_adapters_still_load(server, base, client, dirs):
    root, _ = dirs
    fifo = bad_copy(root, "fifo", lambda p: ((p / WEIGHTS_FILE).unlink(), os.mkfifo(p / WEIGHTS_FILE)))
    with victim_beside(server, base):
        for attempt in range(3):  # more than the loader's threads: none may be left blocked
            assert load_status(client, f"fifo-{attempt}", fifo.as_uri()) == INVALID
        assert load_status(client, "after-fifo", (root / "good").as_uri()) == OK


def test_credentials_in_a_uri(server, base, client, dirs):
    root, _ = dirs
    with victim_beside(server, base):
        uri = f"file://admin:hunter2secret@localhost{root / 'good'}"
        assert load_status(client, "creds", uri) == INVALID
        assert load_status(client, "creds", "s3://AKIA:hunter2secret@bucket/a") == INVALID
    assert "hunter2secret" not in server.log()


def test_no_allow_list_refuses_every_uri(dirs, tmp_path):
    root, _ = dirs
    bare = start_inference_server(["--model", "builtin:tiny", "--max-loras", "2"], log_dir=tmp_path)
    try:
        alone = solo_run(bare, max_new_tokens=VICTIM_TOKENS)
        with InferenceClient(bare.address) as c, victim_beside(bare, alone):
            for uri in ((root / "good").as_uri(), "s3://bucket/adapters/a", "https://example.com/a"):
                with pytest.raises(grpc.RpcError) as info:
                    c.load_adapter("a", uri, timeout=60)
                assert info.value.code() == DENIED and "--adapter-source-allow" in info.value.details()
    finally:
        bare.stop()
