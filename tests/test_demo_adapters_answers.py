"""The `bullets` demo adapter answers right, in its form, on the real model (SmolLM2-135M-Instruct,
GGUF; harness/real_model.py), served as `make run` serves it (--dtype auto, the committed
demo/adapters/bullets).

A few of demo/questions.json's factual questions, asked through the real server and the official
openai SDK's chat route, greedy: every answer mentions an accepted answer, is a `- ` list and does not
loop. The checks are scripts/score_demo_adapters.py's own, which scores all 20 questions on every
demo adapter beside the base model.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from harness.inference_server import start_inference_server
from harness.real_model import require_real_model

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("score_demo_adapters", ROOT / "scripts" / "score_demo_adapters.py")
scoring = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = scoring  # its dataclasses look their module up there
spec.loader.exec_module(scoring)

# Questions the base model answers right, so a right answer from the adapter is the base model's
# knowledge kept.
ASKED = ["What is the capital of France?", "What is the capital of Japan?", "What is the largest ocean on Earth?",
         "What language is spoken in Brazil?", "Who developed the theory of relativity?"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = require_real_model()
    server = start_inference_server(
        ["--model", str(path), "--served-model-name", scoring.BASE, "--dtype", "auto",
         "--lora-modules", f"bullets={ROOT / 'demo' / 'adapters' / 'bullets'}"],
        log_dir=tmp_path_factory.mktemp("demo-answers"), http=True, timeout=300)
    yield server
    server.stop()


@pytest.mark.timeout(600)
def test_bullets_answers_factual_questions_right_as_a_list(server) -> None:
    questions = {q.question: q for q in scoring.load_questions()}
    client = server.openai()
    for text in ASKED:
        reply = client.chat.completions.create(model="bullets", temperature=0, max_tokens=scoring.MAX_TOKENS,
                                               messages=[{"role": "user", "content": text}])
        choice = reply.choices[0]
        answer = scoring.Reply(choice.message.content, choice.finish_reason)
        assert scoring.correct("bullets", answer, questions[text]), (text, answer)
        assert scoring.in_style("bullets", answer), (text, answer)
