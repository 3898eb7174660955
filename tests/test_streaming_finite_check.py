"""`StreamingFiniteCheck` (the sidecar's NaN/Inf check on parts as they download) against the
whole-file check it replaces: same verdict for any part size, any arrival order after the first
part, any dtype, and a bad value anywhere, including in an element split between two parts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from inference_service.errors import AdapterError
from inference_service.lora.adapter import StreamingFiniteCheck, _all_finite, safetensors_manifest, tensors_from_buffer

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _whole_file_verdict(data: bytes) -> bool:
    tensors = tensors_from_buffer(data, safetensors_manifest(data))
    return all(_all_finite(t) for t in tensors.values() if t.numel())


def _streamed_verdict(data: bytes, part_bytes: int, order: list[int]) -> bool:
    check = StreamingFiniteCheck(len(data))
    rest = list(range(part_bytes, len(data), part_bytes))
    rest.sort(key=lambda start: order[start // part_bytes % len(order)] if order else start)  # any order
    for start in [0, *rest]:
        check.add(start, memoryview(bytearray(data[start : start + part_bytes])))
    try:
        assert check.finish(data), "the header fitted in the first part: the streamed check must have run"
    except AdapterError as exc:
        assert "non-finite" in str(exc)
        return False
    return True


@settings(max_examples=150, deadline=None)
@given(
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=1, max_size=4),
    numels=st.lists(st.integers(1, 40), min_size=4, max_size=4),  # a zero dim is refused by the header check
    bad=st.none() | st.tuples(st.integers(0, 3), st.integers(0, 39), st.sampled_from([float("nan"), float("inf")])),
    extra_part=st.integers(1, 61),
    order=st.lists(st.integers(0, 100), max_size=20),
)
def test_streamed_check_agrees_with_the_whole_file(dtypes, numels, bad, extra_part, order):
    tensors = {f"t{i}": torch.randn(numels[i]).to(dtypes[i % len(dtypes)]) for i in range(len(dtypes))}
    if bad is not None:
        index, position, value = bad
        name = f"t{index % len(dtypes)}"
        if tensors[name].numel():
            tensors[name][position % tensors[name].numel()] = value
    data = save(tensors)
    header = 8 + int.from_bytes(data[:8], "little")
    part_bytes = header + extra_part  # the first part holds the header; later ones split elements
    assert _streamed_verdict(data, part_bytes, order) == _whole_file_verdict(data)


def test_header_larger_than_the_first_part_leaves_the_check_to_the_full_validation():
    data = save({"a": torch.tensor([float("nan"), 1.0])})
    check = StreamingFiniteCheck(len(data))
    for start in range(0, len(data), 16):
        check.add(start, memoryview(bytearray(data[start : start + 16])))
    assert check.finish(data) is False


def test_a_value_split_between_parts_is_caught():
    data = bytearray(save({"a": torch.ones(8)}))
    header = 8 + int.from_bytes(data[:8], "little")
    data[header + 12 : header + 16] = torch.tensor([float("nan")]).numpy().tobytes()  # element 3
    part_bytes = header + 14  # element 3 is bytes 12..16 of the data: split at 14
    check = StreamingFiniteCheck(len(data))
    for start in range(0, len(data), part_bytes):
        check.add(start, memoryview(data[start : start + part_bytes]))
    with pytest.raises(AdapterError, match="'a' contains non-finite"):
        check.finish(bytes(data))
