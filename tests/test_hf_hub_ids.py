"""Hugging Face model ids (`--model org/name`) served from the Hugging Face cache, offline first.

There is no network to the hub here: the cache is written as huggingface_hub writes it
(harness/hf_cache.py), and the first test proves huggingface_hub's own readers see it. In-process
tests point huggingface_hub at the test's cache through its `constants` module (what HF_HOME and
HF_HUB_OFFLINE set when it is imported); the server test sets the real environment variables.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adapter_cache.errors import FailedPreconditionError
from harness.hf_cache import add_checkpoint
from harness.models import make_checkpoint
from inference_service.models.loader import load_model

CPU = torch.device("cpu")
REPO = "tiny-org/tiny-llama"
COMMIT_OLD = "1" * 40
COMMIT_NEW = "2" * 40


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """Two revisions of one repo: the old one tagged v1, the new one on main (other weights)."""
    root = tmp_path_factory.mktemp("hf")
    old = make_checkpoint(root / "old", "llama", seed=1)
    new = make_checkpoint(root / "new", "llama", seed=2)
    home = root / "home"
    add_checkpoint(home / "hub", REPO, COMMIT_OLD, old, refs=("v1",))
    add_checkpoint(home / "hub", REPO, COMMIT_NEW, new, refs=("main",))
    return home


@pytest.fixture
def hub_env(hf_home, monkeypatch) -> Path:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hf_home


def test_huggingface_hub_reads_the_cache_as_written(hf_home):
    from huggingface_hub import scan_cache_dir, snapshot_download, try_to_load_from_cache

    cache = hf_home / "hub"
    info = scan_cache_dir(cache)
    assert not info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_type == "model"
    revisions = {r.commit_hash: r for r in repo.revisions}
    assert set(revisions) == {COMMIT_OLD, COMMIT_NEW}
    assert revisions[COMMIT_NEW].refs == frozenset({"main"}) and revisions[COMMIT_OLD].refs == frozenset({"v1"})
    assert {f.file_name for f in revisions[COMMIT_NEW].files} >= {"config.json", "model.safetensors",
                                                                   "tokenizer.json"}
    found = try_to_load_from_cache(REPO, "config.json", cache_dir=cache, revision="v1")
    assert found == str(cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT_OLD / "config.json")
    snapshot = snapshot_download(REPO, cache_dir=cache, local_files_only=True)
    assert Path(snapshot).name == COMMIT_NEW and (Path(snapshot) / "model.safetensors").is_file()


def _weights(model) -> torch.Tensor:
    return model.embed_tokens.weight.detach().clone()


def test_model_id_serves_from_the_cache_and_revision_pins_it(hub_env, hf_home):
    snapshots = hf_home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots"
    main, _ = load_model(REPO, CPU, torch.float32)
    assert main.config.name == REPO
    assert torch.equal(_weights(main), _weights(load_model(str(snapshots / COMMIT_NEW), CPU, torch.float32)[0]))
    old = _weights(load_model(str(snapshots / COMMIT_OLD), CPU, torch.float32)[0])
    for revision in ("v1", COMMIT_OLD):
        pinned, _ = load_model(REPO, CPU, torch.float32, revision=revision)
        assert torch.equal(_weights(pinned), old), revision
    assert not torch.equal(old, _weights(main))


def test_id_not_in_the_cache_offline_says_how_to_fetch_it(hub_env):
    with pytest.raises(FailedPreconditionError, match=r"tiny-org/absent@main is not in the Hugging Face cache "
                       r"and the hub is offline.*hf download tiny-org/absent --revision main"):
        load_model("tiny-org/absent", CPU, torch.float32)
    with pytest.raises(FailedPreconditionError, match=f"{REPO}@v9 is not in the Hugging Face cache"):
        load_model(REPO, CPU, torch.float32, revision="v9")


def test_id_not_in_the_cache_with_the_hub_unreachable_says_how_to_fetch_it(hub_env, monkeypatch):
    """Online, a missing id is downloaded; a hub that refuses the connection (a closed loopback
    port) ends in the same actionable error, not a traceback."""
    from huggingface_hub import constants

    from harness.ports import free_port

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(FailedPreconditionError, match="could not be downloaded.*hf download tiny-org/absent"):
        load_model("tiny-org/absent", CPU, torch.float32)


def test_revision_is_refused_for_a_local_path(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "m", "llama")
    with pytest.raises(FailedPreconditionError, match="--revision applies to Hugging Face model ids"):
        load_model(str(checkpoint), CPU, torch.float32, revision="main")


def test_server_serves_a_model_id_from_hf_home(hf_home, inference_server_factory):
    """The real server: --model org/name --revision v1 with HF_HOME and HF_HUB_OFFLINE=1 set."""
    import urllib.request

    server = inference_server_factory("--model", REPO, "--revision", "v1", http=True,
                                      env={"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})
    with urllib.request.urlopen(f"{server.http_url}/v1/models", timeout=10) as resp:
        models = json.load(resp)["data"]
    assert [m["id"] for m in models] == [REPO]
    log = server.log()
    assert f"snapshots/{COMMIT_OLD}" in log, log[-2000:]
