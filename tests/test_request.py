"""A request's token ranges, read without joining prompt and output."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from inference_service.engine.request import Request, SamplingParams


@given(
    prompt=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    output=st.lists(st.integers(10, 19), max_size=8),
    data=st.data(),
)
def test_token_ids_is_a_slice_of_prompt_then_output(prompt, output, data):
    request = Request("r", prompt, SamplingParams())
    request.output_token_ids.extend(output)
    everything = prompt + output
    end = data.draw(st.integers(0, len(everything)))
    start = data.draw(st.integers(0, end))
    assert request.token_ids(start, end) == everything[start:end]
