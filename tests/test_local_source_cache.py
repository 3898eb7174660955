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


def test_a_checksum_asked_of_an_entry_read_without_one_reads_the_file_again(tmp_path):
    """The raw bytes are not kept with a cached entry, so a digest not taken when the file was
    read is taken by reading it again, and still enforced."""
    path = write_tiny_adapter(tmp_path / "a", seed=1)
    digest = hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()
    source = LocalDirectorySource(SHAPES, max_rank=8, cache_bytes=64 << 20)
    source.fetch(str(path), None)
    assert source.fetch(str(path), digest).tier == "store"
    assert source.fetch(str(path), digest).tier == "cache"
    with pytest.raises(InvalidArgumentError, match="sha256"):
        source.fetch(str(path), "0" * 64)
