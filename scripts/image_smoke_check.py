"""What the image's services import at run time, imported and used once in the image's build: the
servers' modules, and the structured-output path end to end (xgrammar compiles a JSON schema against
a byte vocabulary, a matcher masks logits with engine/grammar.py), so a package the image leaves out
(pyproject.toml's [tool.loraplex.image]) that something does need fails the build, not a request."""

import importlib
import json
from importlib.metadata import version

import torch

for module in ("adapter_cache.cli", "inference_service.cli", "inference_service.engine.grammar",
               "inference_service.frontend.grammar_check"):
    importlib.import_module(module)

import xgrammar as xgr  # noqa: E402

from inference_service.engine.grammar import mask_logits, new_matcher  # noqa: E402
from inference_service.structured import GrammarSpec, compile_spec, tokenizer_info  # noqa: E402

vocab = [bytes([b]) for b in range(256)] + [b""]  # one token per byte, and a stop token
compiler = xgr.GrammarCompiler(tokenizer_info(vocab, [256]), max_threads=1, cache_enabled=False)
schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
matcher = new_matcher(compile_spec(compiler, GrammarSpec("json_schema", json.dumps(schema))))
allowed = torch.isfinite(mask_logits(torch.zeros(1, len(vocab)), [matcher])[0]).nonzero().flatten().tolist()
assert allowed == [ord("{")], allowed
print(f"torch {torch.__version__}; structured output: xgrammar {version('xgrammar')} compiles and masks")
