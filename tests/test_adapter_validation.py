"""Malformed and unsupported adapters through `EngineCore.lora.load_adapter`, and the same ones
staged by a real adapter-cache sidecar (same codes); the local source's file-access rule.

Each case is a good PEFT adapter for builtin:tiny with one thing broken (its JSON config or its
safetensors bytes edited). Every rejection must carry the documented error class and gRPC code
and leave nothing behind: no registry entry, no slot, no pending load, no pin. Afterwards the
same name loads a good adapter and a request on it completes, so the engine stays healthy.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from adapter_cache.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from adapter_cache.errors import (
    AdapterError,
    AdapterIncompatibleError,
    InvalidArgumentError,
    LoraplexError,
    NotFoundError,
    PermissionDeniedError,
)
from adapter_cache.uri_policy import UriPolicy
from harness.bad_adapters import (
    A0,
    B1,
    DELETE,
    MAX_RANK,
    RANK,
    SHAPES,
    Edit,
    add_layer,
    alias_offsets,
    append_bytes,
    config_bytes,
    down_out,
    drop,
    duplicate_tensor,
    edit_config,
    edit_header,
    edit_tensors,
    first_tensor,
    good_config,
    good_config_text,
    good_tensors,
    huge_sparse_weights,
    key,
    offsets_negative,
    offsets_not_matching_shape,
    offsets_past_end,
    overlap_offsets,
    q_in,
    remove,
    rename_tensor,
    replace,
    set_value,
    truncate_weights,
    weights_a_directory,
    write_adapter,
    write_bytes,
)
from harness.engine_helpers import load_adapters, run_to_completion
from harness.sidecar import Sidecar
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import FinishReason, Request, SamplingParams
from inference_service.lora.source import LocalDirectorySource

# (id, edit, exact error class); the code follows from the class and is checked too.
CASES: list[tuple[str, Edit, type[LoraplexError]]] = [
    # rank
    ("rank-above-max", edit_config(r=MAX_RANK * 2), AdapterError),
    ("rank-pattern-above-max", edit_config(rank_pattern={"q_proj": MAX_RANK + 1}), AdapterError),
    ("tensor-rank-above-max", edit_tensors(lambda t: t.update(good_tensors(rank=MAX_RANK + 4))), AdapterError),
    # target modules
    ("target-embed_tokens", edit_config(target_modules=["q_proj", "embed_tokens"]), AdapterError),
    ("target-lm_head", edit_config(target_modules=["lm_head"]), AdapterError),
    ("target-regex-matches-nothing", edit_config(target_modules=r".*\.embed_tokens"), AdapterError),
    ("target-empty", edit_config(target_modules=[]), AdapterError),
    ("tensor-embed_tokens", edit_tensors(replace("base_model.model.model.embed_tokens.lora_A.weight",
                                                 torch.zeros(RANK, 258))), AdapterError),
    ("tensor-lm_head", edit_tensors(replace("base_model.model.lm_head.lora_B.weight", torch.zeros(258, RANK))),
     AdapterError),
    ("tensor-module-under-wrong-parent", edit_tensors(replace(
        "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight", torch.zeros(RANK, q_in))), AdapterError),
    # shapes
    ("lora_A-in-features", edit_tensors(replace(A0, torch.zeros(RANK, q_in + 1))), AdapterError),
    ("lora_B-out-features", edit_tensors(replace(B1, torch.zeros(down_out * 2, RANK))), AdapterError),
    ("A-B-rank-mismatch", edit_tensors(replace(A0, torch.zeros(RANK - 1, q_in))), AdapterError),
    ("lora_B-missing", edit_tensors(drop(key(0, "v_proj", "B"))), AdapterError),
    ("tensor-3d", edit_tensors(replace(A0, torch.zeros(1, RANK, q_in))), AdapterError),
    ("more-layers-than-base", edit_tensors(add_layer(SHAPES.num_layers)), AdapterIncompatibleError),
    # unsupported PEFT features
    ("dora", edit_config(use_dora=True), AdapterError),
    ("modules_to_save", edit_config(modules_to_save=["lm_head"]), AdapterError),
    ("lora_bias", edit_config(lora_bias=True), AdapterError),
    ("bias-all", edit_config(bias="all"), AdapterError),
    ("peft-type-ia3", edit_config(peft_type="IA3"), AdapterError),
    # non-finite values
    ("nan", edit_tensors(set_value(A0, math.nan)), AdapterError),
    ("inf", edit_tensors(set_value(B1, math.inf)), AdapterError),
    ("minus-inf", edit_tensors(set_value(A0, -math.inf)), AdapterError),
    ("nan-fp16", edit_tensors(lambda t: (t.update({k: v.half() for k, v in t.items()}),
                                         set_value(B1, math.nan)(t))), AdapterError),
    # truncated / malformed safetensors
    ("truncated-mid-data", truncate_weights(lambda n: n - 100), AdapterError),
    ("truncated-mid-header", truncate_weights(lambda n: 40), AdapterError),
    ("truncated-below-length-prefix", truncate_weights(lambda n: 5), AdapterError),
    ("empty-weights-file", write_bytes(WEIGHTS_FILE, b""), AdapterError),
    ("garbage", write_bytes(WEIGHTS_FILE, bytes(range(256)) * 8), AdapterError),
    ("header-bad-json", write_bytes(WEIGHTS_FILE, struct.pack("<Q", 9) + b"{not json" + b"\0" * 64),
     AdapterError),
    ("header-not-utf8", write_bytes(WEIGHTS_FILE, struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc"), AdapterError),
    ("header-a-list", write_bytes(WEIGHTS_FILE, struct.pack("<Q", 2) + b"[]"), AdapterError),
    ("header-no-tensors", write_bytes(WEIGHTS_FILE, struct.pack("<Q", 2) + b"{}"), AdapterError),
    ("offsets-past-end", edit_header(offsets_past_end), AdapterError),
    ("offsets-not-matching-shape", edit_header(offsets_not_matching_shape), AdapterError),
    ("offsets-negative", edit_header(offsets_negative), AdapterError),
    ("entry-without-offsets", edit_header(lambda h: first_tensor(h).pop("data_offsets")), AdapterError),
    ("dtype-int64", edit_header(lambda h: first_tensor(h).update(dtype="I64")), AdapterError),
    # missing files
    ("no-config-file", remove(CONFIG_FILE), NotFoundError),
    ("no-weights-file", remove(WEIGHTS_FILE), NotFoundError),
    # bad adapter_config.json
    ("config-not-json", write_bytes(CONFIG_FILE, b"{r: 4, lora_alpha: 8"), AdapterError),
    ("config-not-utf8", write_bytes(CONFIG_FILE, b"\xff\xfe{}"), AdapterError),
    ("config-a-list", write_bytes(CONFIG_FILE, b"[1, 2]"), AdapterError),
    ("r-missing", edit_config(r=DELETE), AdapterError),
    ("r-zero", edit_config(r=0), AdapterError),
    ("r-negative", edit_config(r=-4), AdapterError),
    ("r-string", edit_config(r="4"), AdapterError),
    ("r-float", edit_config(r=4.5), AdapterError),
    ("r-bool", edit_config(r=True), AdapterError),
    ("lora_alpha-nan", edit_config(lora_alpha=math.nan), AdapterError),
    ("lora_alpha-inf", edit_config(lora_alpha=math.inf), AdapterError),
    ("lora_alpha-string", edit_config(lora_alpha="8"), AdapterError),
    ("lora_alpha-zero", edit_config(lora_alpha=0), AdapterError),
    ("lora_alpha-negative", edit_config(lora_alpha=-8), AdapterError),
    # the PEFT regexes: run by RE2 in linear time, refused where RE2 cannot match them
    ("target-regex-catastrophic", edit_config(target_modules="(.+.+)+Z"), AdapterError),  # matches nothing
    ("target-regex-invalid", edit_config(target_modules="(q_proj"), AdapterError),
    ("target-regex-lookbehind", edit_config(target_modules="(?<=self_attn\\.)q_proj"), AdapterError),
    ("target-regex-backreference", edit_config(target_modules="(q)_proj\\1"), AdapterError),
    ("target-modules-not-strings", edit_config(target_modules=[["q_proj"]]), AdapterError),
    ("target-modules-number", edit_config(target_modules=7), AdapterError),
    ("alpha-pattern-key-invalid-regex", edit_config(alpha_pattern={"q_proj(": 4}), AdapterError),
    ("alpha-pattern-inf-string", edit_config(alpha_pattern={"q_proj": "inf"}), AdapterError),
    ("alpha-pattern-inf", edit_config(alpha_pattern={"q_proj": math.inf}), AdapterError),
    ("alpha-pattern-zero", edit_config(alpha_pattern={"q_proj": 0}), AdapterError),
    ("alpha-pattern-a-list", edit_config(alpha_pattern=[["q_proj", 4]]), AdapterError),
    ("rank-pattern-float", edit_config(rank_pattern={"q_proj": 4.5}), AdapterError),
    ("rank-pattern-string", edit_config(rank_pattern={"q_proj": "4"}), AdapterError),
    ("rank-pattern-bool", edit_config(rank_pattern={"q_proj": True}), AdapterError),
    ("rank-pattern-key-invalid-regex", edit_config(rank_pattern={"[q": 4}), AdapterError),
    # flags: JSON booleans only ("false" is a true value in Python)
    ("use_rslora-string-false", edit_config(use_rslora="false"), AdapterError),
    ("use_rslora-number", edit_config(use_rslora=0), AdapterError),
    ("peft-type-not-a-string", edit_config(peft_type=["LORA"]), AdapterError),
    # layers_to_transform: typed, and checked against the model and the tensors
    ("layers_to_transform-string", edit_config(layers_to_transform="0"), AdapterError),
    ("layers_to_transform-negative", edit_config(layers_to_transform=[-1]), AdapterError),
    ("layers_to_transform-beyond-model", edit_config(layers_to_transform=list(range(SHAPES.num_layers + 1))),
     AdapterIncompatibleError),
    ("tensors-outside-layers_to_transform", edit_config(layers_to_transform=[0]), AdapterError),
    # JSON the parser must refuse fast, not with a traceback
    ("config-deeply-nested", config_bytes(good_config_text(extra="[" * 100_000 + "]" * 100_000)), AdapterError),
    ("config-nested-past-limit", config_bytes(good_config_text(extra="[" * 40 + "]" * 40)), AdapterError),
    ("config-5000-digit-int", config_bytes(good_config_text(lora_alpha="9" * 5000)), AdapterError),
    ("config-float-overflow", config_bytes(good_config_text(lora_alpha="1e999")), AdapterError),
    ("config-duplicate-key", config_bytes(good_config_text(r="2")), AdapterError),
    ("config-utf16", config_bytes(json.dumps(good_config()).encode("utf-16")), AdapterError),
    ("config-over-1MiB", config_bytes(good_config_text(padding='"' + "x" * (1 << 20) + '"')), InvalidArgumentError),
    # safetensors header: validated before any data pass
    ("dtype-a-list", edit_header(lambda h: first_tensor(h).update(dtype=["F32"])), AdapterError),
    ("dtype-a-number", edit_header(lambda h: first_tensor(h).update(dtype=32)), AdapterError),
    ("shape-negative-dims", edit_header(lambda h: first_tensor(h).update(shape=[-RANK, -q_in])), AdapterError),
    ("shape-zero-dim", edit_header(lambda h: first_tensor(h).update(shape=[0, q_in], data_offsets=[0, 0])),
     AdapterError),
    ("shape-float-dim", edit_header(lambda h: first_tensor(h).update(shape=[float(RANK), q_in])), AdapterError),
    ("shape-bool-dim", edit_header(lambda h: first_tensor(h).update(shape=[True, q_in])), AdapterError),
    ("shape-5000-digit-dim", write_bytes(WEIGHTS_FILE, struct.pack("<Q", 5100) + (
        b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}').ljust(5100)),
     AdapterError),
    ("offsets-aliased", edit_header(alias_offsets), AdapterError),
    ("offsets-overlapping", edit_header(overlap_offsets), AdapterError),
    ("offsets-floats", edit_header(lambda h: first_tensor(h).update(
        data_offsets=[float(o) for o in first_tensor(h)["data_offsets"]])), AdapterError),
    ("bytes-after-last-tensor", append_bytes(b"\0" * 64), AdapterError),
    ("header-over-limit", write_bytes(WEIGHTS_FILE, struct.pack("<Q", 9 << 20) + b"{}"), AdapterError),
    ("header-length-2**63", write_bytes(WEIGHTS_FILE, struct.pack("<Q", 1 << 63) + b"{}"), AdapterError),
    ("header-deeply-nested", write_bytes(WEIGHTS_FILE, struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000),
     AdapterError),
    ("header-entry-extra-field", edit_header(lambda h: first_tensor(h).update(extra=1)), AdapterError),
    ("header-metadata-not-strings", edit_header(lambda h: h.update(__metadata__={"format": 1})), AdapterError),
    ("tensor-named-twice-leading-zero", duplicate_tensor(A0, A0.replace("layers.0.", "layers.00.")), AdapterError),
    ("tensor-named-twice-without-prefix", duplicate_tensor(A0, A0.removeprefix("base_model.model.")),
     AdapterError),
    ("tensor-layer-arabic-digit", rename_tensor(A0, A0.replace("layers.0.", "layers.\u0660.")), AdapterError),
    # the file itself
    ("weights-64GiB-sparse", huge_sparse_weights, InvalidArgumentError),
    ("weights-a-directory", weights_a_directory, InvalidArgumentError),
]


# ---- fixtures and checks ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def core() -> EngineCore:
    core = EngineCore(EngineConfig(max_loras=2, max_lora_rank=MAX_RANK, kv_cache_bytes=4 << 20, device="cpu"))
    yield core
    core.shutdown()


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return write_adapter(tmp_path_factory.mktemp("adapters") / "good")


def snapshot(core: EngineCore) -> dict:
    lora = core.lora
    return {
        "versions": dict(lora._registry.versions),
        "current": dict(lora._registry.current),
        "slots": list(lora._pool.slot_to_uid),
        "uid_to_slot": dict(lora._pool.uid_to_slot),
        "pending": dict(lora._loader.pending),
        "pinned": core.stats().slots_pinned,
        "refs": lora.stats().references,
    }


def expect_rejected(core: EngineCore, name: str, uri: str, error: type[LoraplexError], **kwargs: object
                    ) -> LoraplexError:
    """Load must fail with exactly `error` (and its code) and leave the manager as it was."""
    before = snapshot(core)
    with pytest.raises(LoraplexError) as info:
        load_adapters(core, {name: uri}, **kwargs)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert info.value.code == error.code
    assert str(info.value)  # a message naming the problem
    core.lora.drain()
    assert snapshot(core) == before
    assert not core.lora.has_pending_work()
    assert name not in core.lora._registry.current or before["current"].get(name) == core.lora.uid_of(name)
    return info.value


def serve_one(core: EngineCore, adapter: str | None, rid: str, n: int = 4) -> list[int]:
    core.add_request(Request(rid, [256, 72, 105], SamplingParams(max_new_tokens=n, ignore_eos=True)), adapter)
    outputs = run_to_completion(core)[rid]
    assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.LENGTH, outputs[-1]
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert len(tokens) == n
    return tokens


def unload(core: EngineCore, name: str) -> None:
    future = core.lora.unload_adapter(name)
    core.lora.drain()
    future.result(timeout=10)


def expect_healthy(core: EngineCore, name: str, good: Path) -> None:
    """The rejected name loads a good adapter; a request on it completes; nothing leaks."""
    load_adapters(core, {name: good})
    serve_one(core, name, f"after-{name}")
    unload(core, name)
    stats = core.stats()
    assert stats.adapter_references == 0 and stats.kv_blocks_used == 0 and stats.pending_load_events == 0
    assert core.lora._registry.versions == {} and core.lora._registry.current == {}


# ---- tests -------------------------------------------------------------------------------------


def test_good_adapter_loads_and_serves(core, good):
    load_adapters(core, {"good": good}, preload=True)
    assert core.lora.state("good@1").value == "LOADED"
    with_adapter = serve_one(core, "good", "good-req", n=8)
    base = serve_one(core, None, "base-req", n=8)
    assert with_adapter != base  # the adapter changes the output
    unload(core, "good")
    assert core.lora._registry.versions == {}


@pytest.mark.parametrize("case_id, edit, error", CASES, ids=[c[0] for c in CASES])
def test_rejected(core, good, tmp_path, case_id, edit, error):
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    edit(bad)
    expect_rejected(core, "adapter", str(bad), error)
    expect_healthy(core, "adapter", good)


def test_rejected_with_preload_and_pin_takes_no_slot(core, good, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    edit_tensors(set_value(A0, math.nan))(bad)
    expect_rejected(core, "adapter", str(bad), AdapterError, preload=True, pinned=True)
    assert core.stats().slots_pinned == 0 and core.stats().slots_occupied == 0
    expect_healthy(core, "adapter", good)


def test_missing_directory(core, good, tmp_path):
    expect_rejected(core, "adapter", str(tmp_path / "does-not-exist"), NotFoundError)
    expect_rejected(core, "adapter", f"file://{tmp_path}/does-not-exist", NotFoundError)
    expect_healthy(core, "adapter", good)


def test_sha256(core, good):
    digest = hashlib.sha256((good / WEIGHTS_FILE).read_bytes()).hexdigest()
    error = expect_rejected(core, "adapter", str(good), InvalidArgumentError, sha256="0" * 64)
    assert "sha256" in str(error)
    # The right digest (any case) loads.
    load_adapters(core, {"adapter": good}, sha256=digest.upper())
    serve_one(core, "adapter", "sha-ok")
    unload(core, "adapter")
    expect_healthy(core, "adapter", good)


@pytest.mark.parametrize("template", [
    "file://{parent}/elsewhere/../good",
    "file://{parent}/good/../../{leaf}/good",
    "file://{parent}/%2E%2E/{leaf}/good",
    "{parent}/elsewhere/../good",
    "file://remote-host{parent}/good",
], ids=["dotdot", "dotdot-up-and-back", "percent-encoded-dotdot", "plain-path-dotdot", "remote-host"])
def test_path_traversal_denied(core, good, template):
    # Each URI would resolve to the good adapter: only the traversal itself is refused.
    uri = template.format(parent=good.parent, leaf=good.parent.name)
    expect_rejected(core, "adapter", uri, PermissionDeniedError)
    expect_healthy(core, "adapter", good)


def test_failed_new_version_keeps_current_one_serving(core, good, tmp_path):
    """A bad v2 of a live name fails alone: v1 stays current and keeps serving."""
    load_adapters(core, {"live": good})
    before = serve_one(core, "live", "live-before")
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    edit_config(use_dora=True)(bad)
    expect_rejected(core, "live", str(bad), AdapterError)
    assert core.lora._registry.current == {"live": "live@1"}
    assert serve_one(core, "live", "live-after") == before
    unload(core, "live")
    expect_healthy(core, "live", good)


# ---- the local source's file-access rule (shared with the sidecar's FileStore) -----------------


@pytest.fixture
def confined(tmp_path, good) -> tuple[LocalDirectorySource, Path, Path]:
    """A source confined to `root`, and a `secret` directory beside the root holding an adapter."""
    root, secret = tmp_path / "root", tmp_path / "secret"
    root.mkdir()
    shutil.copytree(good, secret)
    shutil.copytree(good, root / "good")
    return LocalDirectorySource(SHAPES, MAX_RANK, cache_bytes=64 << 20, allow=[root.as_uri()]), root, secret


def test_symlinks_out_of_the_root_are_refused_without_echoing_content(confined):
    source, root, secret = confined
    (root / "dir-link").symlink_to(secret)
    (root / "file-links").mkdir()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        (root / "file-links" / name).symlink_to(secret / name)
    for uri in (root / "dir-link", root / "file-links"):
        with pytest.raises(PermissionDeniedError, match="outside every allowed file root") as info:
            source.fetch(uri.as_uri(), None)
        assert "peft_type" not in str(info.value) and str(secret) not in str(info.value)
    (root / "inside-link").symlink_to(root / "good")  # a link that stays inside the root is fine
    assert source.fetch((root / "inside-link").as_uri(), None).rank == RANK


def test_a_directory_swapped_for_a_symlink_is_refused_at_the_next_fetch(confined):
    source, root, secret = confined
    uri = (root / "good").as_uri()
    assert source.fetch(uri, None).tier == "store" and source.fetch(uri, None).tier == "cache"
    shutil.rmtree(root / "good")
    (root / "good").symlink_to(secret)  # same files, now outside: the cached copy must not be served
    with pytest.raises(PermissionDeniedError):
        source.fetch(uri, None)


def test_a_fifo_is_refused_at_once_and_other_adapters_still_load(confined):
    source, root, _ = confined
    shutil.copytree(root / "good", root / "fifo")
    (root / "fifo" / WEIGHTS_FILE).unlink()
    os.mkfifo(root / "fifo" / WEIGHTS_FILE)  # no writer: a blocking open or read would never return
    with pytest.raises(InvalidArgumentError, match="not a regular file"):  # refused before any open
        source.fetch((root / "fifo").as_uri(), None)
    assert source.fetch((root / "good").as_uri(), None).rank == RANK


def test_an_allow_list_without_file_roots_confines_to_nothing(good):
    source = LocalDirectorySource(SHAPES, MAX_RANK, allow=["s3://bucket/adapters/"])
    with pytest.raises(PermissionDeniedError):
        source.fetch(good.as_uri(), None)


@pytest.mark.parametrize("uri", [
    "s3://AKIAEXAMPLE:hunter2secret@bucket/adapters/a",
    "https://user:hunter2secret@models.example.com/adapters/a",
    "file://user:hunter2secret@localhost/srv/adapters/a",
    "user:hunter2secret@bucket/adapters/a",  # no scheme: still masked in the message
])
def test_credentials_in_a_uri_are_refused_and_never_echoed(uri):
    policy = UriPolicy(["s3://bucket/adapters/", "https://models.example.com/adapters/", "file:///srv/adapters"])
    with pytest.raises(InvalidArgumentError) as info:
        policy.check(uri)
    assert "hunter2secret" not in str(info.value)
    assert "credentials" in str(info.value) or "scheme" in str(info.value)


# ---- the same adapters through the adapter-cache sidecar -----------------------------------------

# Without the base model the sidecar cannot judge shapes or layer counts: it stages those, and the
# service refuses them at load. Every other case gets the service's code from the sidecar too.
MODEL_DEPENDENT = {"lora_A-in-features", "lora_B-out-features", "more-layers-than-base",
                   "layers_to_transform-beyond-model"}
SIDECAR_CASES = [case for case in CASES if case[0] not in MODEL_DEPENDENT]


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory) -> Sidecar:
    tmp = tmp_path_factory.mktemp("sidecar")
    (tmp / "adapters").mkdir()
    sc = Sidecar(tmp, allow=[(tmp / "adapters").as_uri()], extra=["--max-rank", str(MAX_RANK), "--no-mlock"])
    yield sc
    sc.stop()


@pytest.mark.parametrize("case_id, edit, error", SIDECAR_CASES, ids=[c[0] for c in SIDECAR_CASES])
def test_rejected_by_the_sidecar(sidecar, good, case_id, edit, error):
    bad = sidecar.tmp / "adapters" / case_id
    shutil.copytree(good, bad)
    edit(bad)
    with pytest.raises(LoraplexError) as info:
        sidecar.client.stage(bad.as_uri(), "", 60)
    assert info.value.code == error.code, f"{info.value.code}: {info.value}"


def test_the_sidecar_refuses_a_fifo_at_once_and_logged_no_traceback(sidecar, good):
    fifo = sidecar.tmp / "adapters" / "fifo"
    shutil.copytree(good, fifo)
    (fifo / WEIGHTS_FILE).unlink()
    os.mkfifo(fifo / WEIGHTS_FILE)
    with pytest.raises(InvalidArgumentError, match="not a regular file"):
        sidecar.client.stage(fifo.as_uri(), "", 60)
    shutil.copytree(good, sidecar.tmp / "adapters" / "good")
    staged = sidecar.client.stage((sidecar.tmp / "adapters" / "good").as_uri(), "", 60)
    sidecar.client.release(staged.lease_id)
    assert "Traceback" not in sidecar.log.read_text()
