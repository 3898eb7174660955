"""The local-directory source keeps validated adapters in host memory (LRU, byte-bounded): a
reload is served from there, a changed file is read again, and a checksum is still enforced."""

from __future__ import annotations

import dataclasses
import hashlib
import os

import pytest
import torch

from adapter_cache.errors import InvalidArgumentError
from harness.adapters import write_tiny_adapter
from inference_service.lora.source import LocalDirectorySource
from inference_service.models.loader import builtin_tiny_config

SHAPES = builtin_tiny_config().lora_shapes()


def weights(adapter) -> list[torch.Tensor]:
    return [t for a, b, _ in adapter.modules.values() for t in (a, b)]


def test_a_reload_comes_from_host_memory(tmp_path):
    path = write_tiny_adapter(tmp_path / "a", seed=1)
    source = LocalDirectorySource(SHAPES, max_rank=8, cache_bytes=64 << 20)
    first, second = source.fetch(str(path), None), source.fetch(str(path), None)
    assert (first.tier, second.tier) == ("store", "cache")
    assert all(x.data_ptr() == y.data_ptr() for x, y in zip(weights(first), weights(second), strict=True))
    assert first is not second, "each fetch gets its own record; the manager sets fields on it"


def test_a_changed_file_is_read_again(tmp_path):
    path = write_tiny_adapter(tmp_path / "a", seed=1)
    source = LocalDirectorySource(SHAPES, max_rank=8, cache_bytes=64 << 20)
    old = source.fetch(str(path), None)
    write_tiny_adapter(tmp_path / "a", seed=2)  # new content (a new file, so a new inode and mtime)
    os.utime(path / "adapter_model.safetensors", ns=(1, 1))
    new = source.fetch(str(path), None)
    assert new.tier == "store"
    assert not all(torch.equal(x, y) for x, y in zip(weights(old), weights(new), strict=True))
    assert source.fetch(str(path), None).tier == "cache"


def test_least_recently_used_leaves_first_within_the_byte_bound(tmp_path):
    paths = [write_tiny_adapter(tmp_path / name, seed=i) for i, name in enumerate("abc")]
    size = LocalDirectorySource(SHAPES, max_rank=8).fetch(str(paths[0]), None).size_bytes
    source = LocalDirectorySource(SHAPES, max_rank=8, cache_bytes=2 * size)
    for p in paths[:2]:
        source.fetch(str(p), None)
    assert source.fetch(str(paths[0]), None).tier == "cache"  # a is now the most recent
    source.fetch(str(paths[2]), None)  # c pushes out b, the least recently used
    assert [source.fetch(str(p), None).tier for p in (paths[0], paths[2])] == ["cache", "cache"]
    assert source.fetch(str(paths[1]), None).tier == "store"


@pytest.mark.parametrize("cache_bytes", [0, 64 << 20])
def test_checksum_is_enforced_on_every_fetch(tmp_path, cache_bytes):
    path = write_tiny_adapter(tmp_path / "a", seed=1)
    source = LocalDirectorySource(SHAPES, max_rank=8, cache_bytes=cache_bytes)
    source.fetch(str(path), None)
    with pytest.raises(InvalidArgumentError, match="sha256"):
        source.fetch(str(path), "0" * 64)
    assert source.fetch(str(path), None).tier == ("cache" if cache_bytes else "store")


def test_the_cache_keeps_the_form_the_caller_loads(tmp_path):
    """With a `host_form` (the slots' layout), a read adapter is brought into it once and the cache
    keeps that form: a reload is handed the same tensors, and host_form is not run again."""
    path = write_tiny_adapter(tmp_path / "a", seed=1)
    source = LocalDirectorySource(SHAPES, max_rank=8, cache_bytes=64 << 20)
    calls = []

    def host_form(adapter):
        calls.append(adapter)
        return dataclasses.replace(adapter, slot_form=True, keepalive=None)

    first = source.fetch(str(path), None, host_form)
    second = source.fetch(str(path), None, host_form)
    assert len(calls) == 1 and first.slot_form and second.slot_form and second.tier == "cache"
    assert all(x.data_ptr() == y.data_ptr() for x, y in zip(weights(first), weights(second), strict=True))


def test_a_checksum_asked_of_an_entry_read_without_one_is_enforced(tmp_path):
    """The digest is taken on every read (it is the cache's key), so an entry read without a
    checksum serves a later fetch that asks for one, and a wrong one is still refused."""
    path = write_tiny_adapter(tmp_path / "a", seed=1)
    digest = hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()
    source = LocalDirectorySource(SHAPES, max_rank=8, cache_bytes=64 << 20)
    source.fetch(str(path), None)
    assert source.fetch(str(path), digest).tier == "cache"
    with pytest.raises(InvalidArgumentError, match="sha256"):
        source.fetch(str(path), "0" * 64)


def test_a_file_rewritten_in_place_with_its_mtime_restored_is_read_again(tmp_path):
    """Same inode, same size, the same mtime put back: only the bytes differ, and the new ones are
    served (the cache is keyed by content, not by the file's metadata)."""
    path = write_tiny_adapter(tmp_path / "a", seed=1)
    source = LocalDirectorySource(SHAPES, max_rank=8, cache_bytes=64 << 20)
    old = source.fetch(str(path), None)
    _rewrite_in_place(path / "adapter_model.safetensors", write_tiny_adapter(tmp_path / "b", seed=2))
    new = source.fetch(str(path), None)
    assert new.tier == "store"
    assert not all(torch.equal(x, y) for x, y in zip(weights(old), weights(new), strict=True))
    fresh = LocalDirectorySource(SHAPES, max_rank=8).fetch(str(path), None)
    assert all(torch.equal(x, y) for x, y in zip(weights(fresh), weights(new), strict=True))


def _rewrite_in_place(target, other_adapter) -> None:
    """`target` overwritten with another adapter's weights of the same size, in the same inode, and
    its access and modification times put back."""
    st = os.stat(target)
    data = (other_adapter / "adapter_model.safetensors").read_bytes()
    assert len(data) == st.st_size
    with open(target, "r+b") as f:
        f.write(data)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(target)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


@pytest.mark.slow
def test_the_server_reloads_what_the_file_holds_now(tmp_path):
    """Through the real server: an adapter loaded, unloaded, its weights rewritten in place (same
    inode and size, mtime put back) and loaded again answers as the new weights do (those same
    weights loaded under another name), not as the old ones."""
    import httpx2 as httpx

    from harness.inference_server import start_inference_server

    path = write_tiny_adapter(tmp_path / "a", seed=1)
    other = write_tiny_adapter(tmp_path / "b", seed=2)
    server = start_inference_server(["--model", "builtin:tiny", "--max-loras", "2", "--max-lora-rank", "8",
                                     "--adapter-source-allow", tmp_path.as_uri() + "/"], log_dir=tmp_path, http=True)
    try:
        def answer(model: str) -> str:
            r = httpx.post(server.http_url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": "the same prompt", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        server.load_http_adapter("a", path)
        server.load_http_adapter("b", other)
        old, new = answer("a"), answer("b")
        assert old != new, "the two adapters must answer differently for this test to see anything"
        r = httpx.post(server.http_url + "/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=60)
        assert r.status_code == 200, r.text
        _rewrite_in_place(path / "adapter_model.safetensors", other)
        server.load_http_adapter("a", path)
        assert answer("a") == new
    finally:
        server.stop()
