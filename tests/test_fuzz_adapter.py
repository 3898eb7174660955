"""Hypothesis fuzzing of the adapter parser: adapter_config.json and the safetensors header, each
from structured strategies (PEFT-shaped objects with wrong types, odd numbers, hostile regexes) and
from raw mutations of a good file. Every outcome is a parsed adapter or a LoraplexError whose code
is INVALID_ARGUMENT or FAILED_PRECONDITION with a message; never another exception, never a hang
(each example must finish within the hypothesis deadline, generous for a loaded 2-core box;
pytest-timeout guards the whole run).

The default run is a few hundred examples per test. A longer run:

    LORAPLEX_FUZZ_EXAMPLES=20000 PYTHONPATH=. .venv/bin/python -m pytest -q tests/test_fuzz_adapter.py

(each run draws fresh examples; a failure prints the seed to reproduce it with --hypothesis-seed=N).
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from inference_service.errors import LoraplexError
from inference_service.lora.adapter import (
    SUPPORTED_TARGET_MODULES,
    build_host_adapter,
    parse_adapter_config,
    parse_adapter_tensors,
    safetensors_manifest,
)
from inference_service.models.loader import builtin_tiny_config

EXAMPLES = int(os.environ.get("LORAPLEX_FUZZ_EXAMPLES", "300"))
MAX_RANK = 8
SHAPES = builtin_tiny_config().lora_shapes()
FUZZ = settings(max_examples=EXAMPLES, deadline=10_000, suppress_health_check=[HealthCheck.too_slow], database=None)
ALLOWED_CODES = {"INVALID_ARGUMENT", "FAILED_PRECONDITION"}
MODULE_PATHS = [f"model.layers.{layer}.{parent}.{module}"
                for layer in range(SHAPES.num_layers) for module, parent in SUPPORTED_TARGET_MODULES.items()]


def outcome(call) -> object:
    """The call's result, or None after a LoraplexError with a documented code and a message."""
    try:
        return call()
    except LoraplexError as exc:
        assert exc.code in ALLOWED_CODES, f"{exc.code}: {exc}"
        assert str(exc) and len(str(exc)) < 1000, "a message naming the problem, not the file"
        return None


# ---- adapter_config.json -------------------------------------------------------------------------

HOSTILE_PATTERNS = ["(.+.+)+Z", "(a|a)*b", "((a*)*)*$", "(?<=q)_proj", r"(\w+)\1", "(", "[", "*", "a{1001}",
                    "q_proj|v_proj", ".*", "", "x" * 2000, "(?P<n>q)_proj", r"\p{L}+", "(?i)Q_PROJ"]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["inf", "-inf", "nan", "false", "true", "8", "all-linear", "LORA", "none"]),
    st.sampled_from(HOSTILE_PATTERNS),
)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8) | st.sampled_from(HOSTILE_PATTERNS), inner,
                                             max_size=4), max_leaves=12)
FIELDS = ["peft_type", "r", "lora_alpha", "use_rslora", "target_modules", "rank_pattern", "alpha_pattern",
          "layers_to_transform", "bias", "use_dora", "modules_to_save", "fan_in_fan_out", "layers_pattern"]
field_values = {
    "r": st.one_of(st.integers(min_value=-2, max_value=MAX_RANK + 2), json_values),
    "lora_alpha": st.one_of(st.floats(allow_nan=False), st.integers(), json_values),
    "target_modules": st.one_of(st.sampled_from(HOSTILE_PATTERNS), st.lists(
        st.sampled_from([*SUPPORTED_TARGET_MODULES, "lm_head", "model.layers.0.self_attn.q_proj"]), max_size=4),
        json_values),
    "rank_pattern": st.dictionaries(st.sampled_from(HOSTILE_PATTERNS), json_values, max_size=3),
    "alpha_pattern": st.dictionaries(st.sampled_from(HOSTILE_PATTERNS), json_values, max_size=3),
    "layers_to_transform": st.one_of(st.integers(min_value=-1, max_value=4), st.lists(st.integers(-1, 4)),
                                     json_values),
}
# A good config with any of its fields replaced.
configs = st.fixed_dictionaries({}, optional={name: field_values.get(name, json_values) for name in FIELDS}).map(
    lambda fields: {"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"], **fields})


def _serialise(config: object) -> bytes:
    return json.dumps(config, allow_nan=True).encode()


def _check_config(raw: bytes | str) -> None:
    config = outcome(lambda: parse_adapter_config(raw, MAX_RANK))
    if config is not None:
        assert 0 < config.rank <= MAX_RANK and isinstance(config.use_rslora, bool)
        for path in MODULE_PATHS:  # every pattern runs against every module path, in linear time
            assert config.scaling(path, config.rank) > 0


@FUZZ
@given(configs)
@example({"r": 4, "target_modules": "(.+.+)+Z|q_proj", "alpha_pattern": {"(.+.+)+Z": 2}})
@example({"r": 4, "target_modules": ["q_proj"], "alpha_pattern": {"q_proj": "inf"}, "use_rslora": "false"})
@pytest.mark.timeout(300)
def test_structured_configs(config):
    _check_config(_serialise(config))


@FUZZ
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
@example(b"[" * 100_000)
@example(b"{\"r\": " + b"9" * 5000 + b"}")
@example("{}".encode("utf-16"))
@example(b'{"r": 4, "r": 8, "target_modules": ["q_proj"]}')
@example(b'{"r": 4, "lora_alpha": 1e999, "target_modules": ["q_proj"]}')
@pytest.mark.timeout(300)
def test_raw_config_bytes(raw):
    _check_config(raw)


@FUZZ
@given(configs, st.integers(min_value=0, max_value=400), st.binary(min_size=1, max_size=8))
@pytest.mark.timeout(300)
def test_mutated_config_text(config, at, junk):
    raw = bytearray(_serialise(config))
    at = min(at, len(raw))
    _check_config(bytes(raw[:at] + junk + raw[at + len(junk):]))


# ---- adapter_model.safetensors -------------------------------------------------------------------


def _good_file(dtype: torch.dtype = torch.float32) -> bytes:
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(SHAPES.num_layers):
        in_f, out_f = SHAPES.features["q_proj"]
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(4, in_f, generator=gen).to(dtype)
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, 4, generator=gen).to(dtype)
    return save(tensors)


GOOD = _good_file()
GOOD_HEADER_LEN = struct.unpack("<Q", GOOD[:8])[0]
GOOD_HEADER = json.loads(GOOD[8 : 8 + GOOD_HEADER_LEN])
CONFIG = parse_adapter_config(b'{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}', MAX_RANK)


def _check_weights(data: bytes) -> None:
    def parse() -> object:
        manifest = safetensors_manifest(data)
        tensors = parse_adapter_tensors(data, CONFIG, MAX_RANK, manifest)
        return build_host_adapter(CONFIG, tensors, SHAPES, keepalive=data)

    adapter = outcome(parse)
    if adapter is not None:
        assert adapter.rank <= MAX_RANK and adapter.size_bytes <= len(data)


def _file(header: object, body: bytes) -> bytes:
    raw = json.dumps(header, allow_nan=True).encode()
    return struct.pack("<Q", len(raw)) + raw + body


dims = st.one_of(st.integers(min_value=-3, max_value=300), st.integers(), st.booleans(), st.floats(),
                 st.text(max_size=3), st.none())
entries = st.fixed_dictionaries(
    {"dtype": st.one_of(st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "U8", "f32"]), json_values),
     "shape": st.one_of(st.lists(dims, max_size=4), json_values),
     "data_offsets": st.one_of(st.lists(st.integers(min_value=-8, max_value=len(GOOD)), min_size=2, max_size=2),
                               st.lists(dims, max_size=3), json_values)},
    optional={"extra": json_values},
)
names = st.one_of(st.sampled_from(sorted(GOOD_HEADER)), st.sampled_from([
    "model.layers.0.self_attn.q_proj.lora_A.weight", "base_model.model.model.layers.01.self_attn.q_proj.lora_A.weight",
    "base_model.model.model.layers.\u0661.self_attn.q_proj.lora_A.weight", "__metadata__"]), st.text(max_size=40))


@FUZZ
@given(st.dictionaries(names, entries | json_values, max_size=6), st.integers(min_value=0, max_value=len(GOOD)))
@pytest.mark.timeout(300)
def test_structured_headers(header, body_len):
    _check_weights(_file(header, GOOD[8 + GOOD_HEADER_LEN :][:body_len]))


@st.composite
def edited_good_header(draw) -> dict:
    """The good header with one entry's field replaced: aliases, overlaps, gaps, odd shapes."""
    header = json.loads(json.dumps(GOOD_HEADER))
    name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    other = header[draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))]
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "alias", "shift"]))
    if field == "alias":
        header[name]["data_offsets"] = list(other["data_offsets"])
    elif field == "shift":
        delta = draw(st.integers(min_value=-64, max_value=64))
        header[name]["data_offsets"] = [o + delta for o in header[name]["data_offsets"]]
    else:
        header[name][field] = draw(entries)[field]
    return header


@FUZZ
@given(edited_good_header())
@pytest.mark.timeout(300)
def test_edited_headers(header):
    _check_weights(_file(header, GOOD[8 + GOOD_HEADER_LEN :]))


@FUZZ
@given(st.lists(st.tuples(st.integers(min_value=0, max_value=len(GOOD) - 1), st.integers(0, 255)), max_size=8),
       st.integers(min_value=0, max_value=len(GOOD)))
@example([], 7)
@example([(7, 0x7F)], len(GOOD))  # a header length near 2**63
@pytest.mark.timeout(300)
def test_mutated_file_bytes(flips, keep):
    data = bytearray(GOOD)
    for at, value in flips:
        data[at] = value
    _check_weights(bytes(data[:keep]))


def test_the_good_inputs_parse():
    """The fuzzers start from inputs that parse, so a failure above is the edit's doing."""
    host = build_host_adapter(CONFIG, parse_adapter_tensors(GOOD, CONFIG, MAX_RANK, safetensors_manifest(GOOD)), SHAPES)
    assert host.rank == 4 and len(host.modules) == SHAPES.num_layers
