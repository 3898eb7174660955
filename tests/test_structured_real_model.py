"""Structured output on the real model (SmolLM2-135M-Instruct, GGUF; harness/real_model.py), through
the server with the openai SDK: its byte-level BPE vocabulary of 49,152 tokens as xgrammar sees it
(special tokens never inside an answer), and an answer to a schema that is valid and sensible."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from harness.inference_server import start_inference_server
from harness.real_model import require_real_model
from inference_service.models.loader import load_model
from inference_service.structured import grammar_vocab

pytestmark = pytest.mark.slow


class Capital(BaseModel):
    country: str = Field(max_length=40)
    capital: str = Field(max_length=40)


def test_real_vocabulary_as_xgrammar_sees_it():
    import torch

    _, tokenizer = load_model(str(require_real_model()), torch.device("cpu"), torch.float32, "auto", None)
    vocab = grammar_vocab(tokenizer, 49152)
    assert len(vocab) == 49152
    special = set(tokenizer.special_token_ids) | set(tokenizer.eos_token_ids)
    assert special and all(vocab[i] == b"" for i in special)  # <|im_end|> never inside a JSON string
    assert sum(1 for v in vocab if v) >= 49152 - len(special)
    assert vocab[tokenizer.encode("{", add_special_tokens=False)[0]] == b"{"


def test_real_model_answers_a_schema(tmp_path):
    server = start_inference_server(["--model", str(require_real_model())], log_dir=tmp_path, http=True, timeout=300)
    try:
        client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        done = client.chat.completions.parse(
            model=client.models.list().data[0].id, response_format=Capital, max_tokens=60, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}])
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), Capital.model_json_schema())
        assert "paris" in choice.message.parsed.capital.lower(), choice.message.content
    finally:
        server.stop()
