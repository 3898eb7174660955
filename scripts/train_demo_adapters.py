"""Train the demo LoRA adapters that `make run` serves on SmolLM2-135M-Instruct (demo/adapters/).

`python scripts/train_demo_adapters.py --model MODEL [--out demo/adapters]` (MODEL: a .gguf file
or a Hugging Face checkpoint directory). CPU only, fixed seeds, one torch thread. The training data
is made here, from nothing downloaded: questions from templates, the base model's own greedy answers
to them, and each answer transformed deterministically into the style an adapter teaches:

  bullets  the answer's complete sentences, one a line as a `- ` list (its content kept whole)
  json     {"answer": "<first sentence>"}
  brief    the first sentence alone

Each adapter is PEFT LoRA (rank 8, alpha 16, on q/k/v/o of the top 16 of the 30 layers, so the
backward pass stops halfway), trained on the assistant's tokens only, and saved in bf16 (about 1 MB).
The questions with the base model's answers are written to
OUT/training_data.json; --reuse-data trains from that file (the committed one) without asking the
base model again. The questions of demo/questions.json, which scripts/score_demo_adapters.py scores
the adapters on, are kept out of the training data; at the end the base model and every adapter
answer them here (fp32, transformers + PEFT), to see by eye.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

SEED = 0
RANK, ALPHA = 8, 16
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LAYERS = list(range(14, 30))
BASE_NAME = "SmolLM2-135M-Instruct"

TEMPLATES: dict[str, list[str]] = {
    "What is the capital of {}?": ["France", "Germany", "Italy", "Spain", "Canada", "Brazil", "Egypt",
                                   "India", "Australia", "Mexico", "Kenya", "Norway", "Greece", "Peru"],
    "What is {}?": ["photosynthesis", "gravity", "a black hole", "DNA", "an atom", "a volcano", "the internet",
                    "democracy", "electricity", "inflation", "a vaccine", "friction", "a glacier", "an eclipse"],
    "Why do {}?": ["birds migrate", "leaves change color in autumn", "cats purr", "we need sleep",
                   "stars twinkle", "onions make us cry", "we have seasons", "people yawn", "bees make honey",
                   "ships float", "we dream", "dogs wag their tails"],
    "How do I {}?": ["boil an egg", "make a cup of tea", "learn to swim", "save money", "plant a tree",
                     "stay focused when studying", "start running", "cook rice", "keep a plant alive",
                     "fall asleep faster", "write a short poem", "tie a tie"],
    "Who was {}?": ["Albert Einstein", "Marie Curie", "Leonardo da Vinci", "William Shakespeare",
                    "Isaac Newton", "Cleopatra", "Wolfgang Amadeus Mozart", "Ada Lovelace", "Charles Darwin",
                    "Nelson Mandela"],
    "What are the benefits of {}?": ["exercise", "reading books", "drinking water", "learning a language",
                                     "meditation", "walking every day", "eating vegetables", "sleeping well"],
    "Tell me about {}.": ["the ocean", "the Moon", "the Sahara desert", "the Amazon rainforest", "honeybees",
                          "volcanoes", "the human heart", "the solar system", "elephants", "the Eiffel Tower",
                          "the Great Wall of China", "penguins"],
    "What is the difference between {}?": ["weather and climate", "a virus and a bacterium", "speed and velocity",
                                           "a lake and a sea", "a frog and a toad", "mass and weight"],
}
# What the adapters are scored on afterwards (never trained on): scripts/score_demo_adapters.py asks them.
QUESTIONS_FILE = Path(__file__).resolve().parents[1] / "demo" / "questions.json"

MAX_ANSWER_TOKENS = 48
CHECK_TOKENS = 64
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def questions() -> list[str]:
    return [template.format(topic) for template, topics in TEMPLATES.items() for topic in topics]


def sentences(answer: str) -> list[str]:
    """Complete sentences only: a last piece without an end mark was cut by the token limit."""
    parts = [p.strip() for p in SENTENCE_END.split(answer.strip()) if p.strip()]
    return [p for p in parts if p[-1] in ".!?"]


@dataclass(frozen=True)
class Style:
    target: Callable[[list[str]], str]  # the base model's complete sentences -> what the adapter answers
    modules: list[str]
    steps: int


STYLES: dict[str, Style] = {
    # The whole answer, one sentence a line: the same words, so the content stays the base model's.
    # (An upper-case style does not: upper-case words are other tokens than the ones a 135M model
    # knows its facts in, and a rank-8 adapter trained on 85 answers spelled them as nonsense.)
    "bullets": Style(lambda s: "\n".join(f"- {x}" for x in s), ATTENTION, 32),
    "json": Style(lambda s: json.dumps({"answer": s[0]}), ATTENTION, 32),
    "brief": Style(lambda s: s[0], ATTENTION, 32),
}


def load(spec: str) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    path = Path(spec)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    root = str(path.parent if path.suffix == ".gguf" else path)
    tok = AutoTokenizer.from_pretrained(root, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32, **kwargs)
    return tok, model.eval()


def prompt_ids(tok: PreTrainedTokenizerBase, question: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)


@torch.no_grad()
def answer(tok: PreTrainedTokenizerBase, model: torch.nn.Module, qs: list[str], max_new: int) -> list[str]:
    """Greedy answers, batched with left padding."""
    out: list[str] = []
    for i in range(0, len(qs), 16):
        batch = [prompt_ids(tok, q) for q in qs[i:i + 16]]
        width = max(map(len, batch))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(b)) + b for b in batch])
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        out += [tok.decode(g[width:], skip_special_tokens=True).strip() for g in gen]
    return out


def batches(tok: PreTrainedTokenizerBase, pairs: list[tuple[str, str]], size: int, steps: int, seed: int):
    """(input_ids, labels) batches over shuffled epochs; labels only on the answer and its <|im_end|>."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    rows = [(p, tok(a, add_special_tokens=False)["input_ids"] + [eos]) for p, a in
            ((prompt_ids(tok, q), a) for q, a in pairs)]
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(steps):
        if len(order) < size:
            order += rng.sample(range(len(rows)), len(rows))
        chosen, order = order[:size], order[size:]
        width = max(len(rows[i][0]) + len(rows[i][1]) for i in chosen)
        ids, labels = [], []
        for i in chosen:
            p, a = rows[i]
            pad = width - len(p) - len(a)
            ids.append(p + a + [tok.pad_token_id] * pad)
            labels.append([-100] * len(p) + a + [-100] * pad)
        yield torch.tensor(ids), torch.tensor(labels)


def answer_loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the answer's positions only: the 49152-way head on every prompt position
    would cost a third of the step."""
    causal_lm = model.get_base_model()
    hidden = causal_lm.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
    targets = labels[:, 1:]
    keep = targets != -100
    logits = causal_lm.lm_head(hidden[keep])
    return torch.nn.functional.cross_entropy(logits, targets[keep])


def train(tok: PreTrainedTokenizerBase, base: PreTrainedModel, pairs: list[tuple[str, str]], out: Path,
          modules: list[str], steps: int, lr: float) -> torch.nn.Module:
    torch.manual_seed(SEED)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=modules, bias="none",
                        layers_to_transform=LAYERS, task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) * (1 - s / steps))
    model.train()
    start = time.monotonic()
    for step, (ids, labels) in enumerate(batches(tok, pairs, 8, steps, SEED)):
        loss = answer_loss(model, ids, labels)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 5 == 0 or step == steps - 1:
            print(f"  {out.name} step {step + 1}/{steps} loss {loss.item():.3f} ({time.monotonic() - start:.0f} s)",
                  file=sys.stderr)
    model.eval()
    save(model, out, modules)
    return model


def save(model: torch.nn.Module, out: Path, modules: list[str]) -> None:
    """bf16 tensors under PEFT's names, and a config that points at the base by name, not a local path."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in get_peft_model_state_dict(model).items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": BASE_NAME, "r": RANK,
              "lora_alpha": ALPHA, "lora_dropout": 0.0, "target_modules": modules, "bias": "none",
              "layers_to_transform": LAYERS, "use_rslora": False, "use_dora": False, "fan_in_fan_out": False}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="SmolLM2-135M-Instruct: a .gguf file or a checkpoint directory")
    p.add_argument("--out", default="demo/adapters")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps per adapter, batch 8 (default: each style's, as the committed ones were made)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--styles", default=",".join(STYLES))
    p.add_argument("--reuse-data", action="store_true", help="take the answers from OUT/training_data.json")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: on a busy machine more threads mostly wait for each other)")
    args = p.parse_args()
    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads)
    start = time.monotonic()
    tok, base = load(args.model)
    qs = questions()
    data_file = Path(args.out) / "training_data.json"
    if args.reuse_data:
        rows = json.loads(data_file.read_text())
        qs, answers = [row["question"] for row in rows], [row["base_answer"] for row in rows]
    else:
        answers = answer(tok, base, qs, MAX_ANSWER_TOKENS)
        data_file.parent.mkdir(parents=True, exist_ok=True)
        data_file.write_text(json.dumps([{"question": q, "base_answer": a} for q, a in zip(qs, answers, strict=True)],
                                        indent=1) + "\n")
    data = [(q, sentences(a)) for q, a in zip(qs, answers, strict=True)]
    scored = [row["question"] for row in json.loads(QUESTIONS_FILE.read_text())]
    data = [(q, s) for q, s in data if s and q not in scored]  # what the adapters are scored on stays out
    print(f"{len(data)} of {len(qs)} questions have a complete first sentence ({time.monotonic() - start:.0f} s)",
          file=sys.stderr)
    report: dict[str, list[str]] = {"base": answer(tok, base, scored, CHECK_TOKENS)}
    for name in args.styles.split(","):
        style = STYLES[name]
        pairs = [(q, style.target(s)) for q, s in data]
        print(f"{name}: e.g. {pairs[0][0]!r} -> {pairs[0][1]!r}", file=sys.stderr)
        model = train(tok, base, pairs, Path(args.out) / name, style.modules, args.steps or style.steps, args.lr)
        report[name] = answer(tok, model, scored, CHECK_TOKENS)
        base = model.unload()  # the base model again, without the adapter's layers
    # A first look in fp32 (the served answers, in bf16, are scored by scripts/score_demo_adapters.py).
    for i, q in enumerate(scored):
        print(f"\nQ: {q}")
        for name, outs in report.items():
            print(f"  {name:5}: {outs[i]}")
    print(f"\ntotal {time.monotonic() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
