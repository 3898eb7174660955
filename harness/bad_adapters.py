"""Adapters with one thing broken, for the validation tests and the isolation attacks: a good PEFT
adapter for builtin:tiny (`write_adapter`) and edits of its JSON config or safetensors bytes."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from adapter_cache.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from inference_service.demo_adapters import write_peft_adapter
from inference_service.models.loader import builtin_tiny_config

MAX_RANK = 8
RANK = 4
SHAPES = builtin_tiny_config().lora_shapes()
MODULES = ("q_proj", "v_proj", "down_proj")
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def key(layer: int, module: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}.lora_{which}.weight"


def good_config(**overrides: object) -> dict:
    """What PEFT writes for a plain LoRA adapter (the fields that matter, plus usual noise)."""
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "builtin:tiny",
        "r": RANK, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": list(MODULES), "bias": "none",
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "fan_in_fan_out": False,
        "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True,
    }
    config.update(overrides)
    return config


def good_tensors(rank: int = RANK, layers: int = SHAPES.num_layers, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in MODULES:
            in_features, out_features = SHAPES.features[module]
            tensors[key(layer, module, "A")] = torch.randn(rank, in_features, generator=gen) * 0.1
            tensors[key(layer, module, "B")] = torch.randn(out_features, rank, generator=gen) * 0.1
    return tensors


def write_adapter(root: Path, config: dict | None = None, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / CONFIG_FILE).write_text(json.dumps(good_config() if config is None else config))
    save_file(good_tensors() if tensors is None else tensors, str(root / WEIGHTS_FILE))
    return root


def header_of(path: Path) -> tuple[dict, bytes]:
    """A safetensors file → (its JSON header, the tensor bytes after it)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def with_header(path: Path, header: dict, body: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


# ---- the broken adapters: each edits a copy of the good one -------------------------------------

Edit = Callable[[Path], None]


def edit_config(**changes: object) -> Edit:
    def edit(root: Path) -> None:
        config = json.loads((root / CONFIG_FILE).read_text())
        for name, value in changes.items():
            if value is DELETE:
                config.pop(name, None)
            else:
                config[name] = value
        (root / CONFIG_FILE).write_text(json.dumps(config))  # NaN is written as the JSON token NaN
    return edit


DELETE = object()  # edit_config(field=DELETE) removes the field


def edit_tensors(change: Callable[[dict[str, torch.Tensor]], None]) -> Edit:
    def edit(root: Path) -> None:
        from safetensors.torch import load_file

        tensors = {k: v.clone() for k, v in load_file(str(root / WEIGHTS_FILE)).items()}
        change(tensors)
        save_file(tensors, str(root / WEIGHTS_FILE))
    return edit


def set_value(name: str, value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name][0, 3] = value
    return change


def replace(name: str, tensor: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensor
    return change


def add_layer(layer: int) -> Callable[[dict[str, torch.Tensor]], None]:
    """As if made for a deeper base model: the same modules on one more layer."""
    def change(tensors: dict[str, torch.Tensor]) -> None:
        for module in MODULES:
            in_features, out_features = SHAPES.features[module]
            tensors[key(layer, module, "A")] = torch.zeros(RANK, in_features)
            tensors[key(layer, module, "B")] = torch.zeros(out_features, RANK)
    return change


def drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[name]
    return change


def write_bytes(file: str, data: bytes) -> Edit:
    def edit(root: Path) -> None:
        (root / file).write_bytes(data)
    return edit


def truncate_weights(keep: Callable[[int], int]) -> Edit:
    def edit(root: Path) -> None:
        data = (root / WEIGHTS_FILE).read_bytes()
        (root / WEIGHTS_FILE).write_bytes(data[: keep(len(data))])
    return edit


def edit_header(change: Callable[[dict], None]) -> Edit:
    def edit(root: Path) -> None:
        header, body = header_of(root / WEIGHTS_FILE)
        change(header)
        with_header(root / WEIGHTS_FILE, header, body)
    return edit


def first_tensor(header: dict) -> dict:
    return header[sorted(k for k in header if k != "__metadata__")[0]]


def offsets_past_end(header: dict) -> None:
    entry = first_tensor(header)
    start, end = entry["data_offsets"]
    entry["data_offsets"] = [start + 10**6, end + 10**6]


def offsets_not_matching_shape(header: dict) -> None:
    entry = first_tensor(header)
    start, end = entry["data_offsets"]
    entry["data_offsets"] = [start, end - 4]


def offsets_negative(header: dict) -> None:
    entry = first_tensor(header)
    start, end = entry["data_offsets"]
    entry["data_offsets"] = [-4, end - start - 4]


def config_bytes(data: bytes) -> Edit:
    """adapter_config.json replaced by `data` as is (what json.dumps cannot write)."""
    return write_bytes(CONFIG_FILE, data)


def good_config_text(**fields: str) -> bytes:
    """The good config as JSON text with `fields` set to raw JSON snippets."""
    text = json.dumps(good_config())[:-1]
    return (text + "".join(f', "{name}": {raw}' for name, raw in fields.items()) + "}").encode()


def second_tensor(header: dict) -> dict:
    return header[sorted(k for k in header if k != "__metadata__")[1]]


def alias_offsets(header: dict) -> None:
    """Two tensors of one shape reading the same bytes."""
    second_tensor(header)["data_offsets"] = list(first_tensor(header)["data_offsets"])


def overlap_offsets(header: dict) -> None:
    entry = second_tensor(header)
    entry["data_offsets"] = [o - 4 for o in entry["data_offsets"]]


def append_bytes(data: bytes) -> Edit:
    def edit(root: Path) -> None:
        with open(root / WEIGHTS_FILE, "ab") as fh:
            fh.write(data)
    return edit


def rename_tensor(old: str, new: str) -> Edit:
    def edit(root: Path) -> None:
        header, body = header_of(root / WEIGHTS_FILE)
        header[new] = header.pop(old)
        with_header(root / WEIGHTS_FILE, header, body)
    return edit


def duplicate_tensor(name: str, alias: str) -> Edit:
    """`alias` names another copy of `name` (its bytes appended): one module given twice."""
    def edit(root: Path) -> None:
        header, body = header_of(root / WEIGHTS_FILE)
        start, end = header[name]["data_offsets"]
        header[alias] = {**header[name], "data_offsets": [len(body), len(body) + end - start]}
        with_header(root / WEIGHTS_FILE, header, body + body[start:end])
    return edit


def huge_sparse_weights(root: Path) -> None:
    """A 64 GiB weights file (sparse): refused by its size, before any byte is read."""
    os.truncate(root / WEIGHTS_FILE, 64 << 30)


def weights_a_directory(root: Path) -> None:
    (root / WEIGHTS_FILE).unlink()
    (root / WEIGHTS_FILE).mkdir()


def remove(file: str) -> Edit:
    def edit(root: Path) -> None:
        (root / file).unlink()
    return edit


A0, B1 = key(0, "q_proj", "A"), key(1, "down_proj", "B")
q_in, q_out = SHAPES.features["q_proj"]
down_in, down_out = SHAPES.features["down_proj"]


def write_admin_error_adapters(root: Path, outside: Path) -> None:
    """The LoadAdapter error cases both front ends test (tests/test_server_errors.py and its HTTP twin):
    `outside/elsewhere` beyond the allow-list, and under `root` rank64, too-many-layers, bad-json,
    truncated and dora."""
    write_peft_adapter(outside / "elsewhere", rank=8, seed=2)
    write_peft_adapter(root / "rank64", rank=64, seed=3)
    write_peft_adapter(root / "too-many-layers", rank=4, seed=4, num_layers=5)
    bad_json = write_peft_adapter(root / "bad-json", rank=4, seed=5)
    (bad_json / "adapter_config.json").write_text("{not json")
    truncated = write_peft_adapter(root / "truncated", rank=4, seed=6)
    data = (truncated / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    dora = write_peft_adapter(root / "dora", rank=4, seed=7)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (dora / "adapter_config.json").write_text(json.dumps(cfg))
