"""Train the demo LoRA adapters that `make run` serves on SmolLM2-135M-Instruct (demo/adapters/).

`python scripts/train_demo_adapters.py --model MODEL [--out demo/adapters]` (MODEL: a .gguf file
or a Hugging Face checkpoint directory). CPU only, fixed seeds, one torch thread. The training data
is made here, from nothing downloaded: questions from templates (general ones, and short factual ones
of the kind the adapters are scored on, on other facts), the base model's own greedy answers to them,
and each answer transformed deterministically into the style an adapter teaches:

  bullets  the answer's complete sentences, one a line as a `- ` list (its content kept whole)
  json     {"answer": "<first sentence>"}
  brief    the first sentence alone

Each adapter is PEFT LoRA, rank 4, alpha 8, on q/k/v/o and gate/up/down of the top 16 of the 30
layers, so the backward pass stops halfway (--rank, --alpha, --first-layer change that), trained on
the assistant's tokens only, 64 steps, and saved in bf16 (about 1.3 MB).
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
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from score_demo_adapters import complete_sentences as sentences  # the scorer's sentence cutting, beside this file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

SEED = 0
RANK, ALPHA = 8, 16
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
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
# Short factual questions of the kind demo/questions.json scores, on other facts (none of the scored
# questions, nor another wording of one): the base model's answers to them teach an adapter to keep
# the base model's facts in its own form.
FACTUAL: dict[str, list[str]] = {
    "What is the capital of {}?": ["Russia", "China", "Portugal", "Sweden", "Poland", "Argentina", "Turkey",
                                   "Ireland", "Austria", "Thailand", "Chile", "Cuba"],
    "What is the chemical symbol for {}?": ["silver", "iron", "oxygen", "sodium", "carbon", "hydrogen",
                                            "copper", "helium", "potassium", "lead"],
    "Who wrote {}?": ["Hamlet", "Pride and Prejudice", "War and Peace", "Don Quixote", "The Odyssey",
                      "Macbeth", "Oliver Twist", "Moby-Dick"],
    "Who painted {}?": ["The Starry Night", "The Scream", "Guernica", "The Girl with a Pearl Earring"],
    "Who invented {}?": ["the telephone", "the light bulb", "the printing press", "the airplane",
                         "the World Wide Web", "dynamite"],
    "Who discovered {}?": ["penicillin", "gravity", "radium", "America"],
    "What language is spoken in {}?": ["Mexico", "Germany", "Egypt", "Argentina", "Sweden", "Greece",
                                       "Russia", "China"],
    "What is the currency of {}?": ["the United States", "the United Kingdom", "India", "China", "Russia",
                                    "Switzerland", "Mexico"],
    "Which planet is {}?": ["closest to the Sun", "known for its rings", "the hottest", "farthest from the Sun"],
    "What is the {}?": ["longest river in the world", "largest desert in the world",
                        "smallest planet in our solar system",
                        "largest country in the world", "hardest natural substance", "fastest land animal",
                        "largest bird in the world"],
    "How many {}?": ["hours are there in a day", "minutes are there in an hour", "planets are in our solar system",
                     "sides does a triangle have", "players are on a soccer team", "months are there in a year",
                     "strings does a violin have", "bones are in the adult human body"],
}
# What the adapters are scored on afterwards (never trained on): scripts/score_demo_adapters.py asks them.
QUESTIONS_FILE = Path(__file__).resolve().parents[1] / "demo" / "questions.json"

MAX_ANSWER_TOKENS = 48
CHECK_TOKENS = 64
def questions() -> list[str]:
    return [template.format(topic) for templates in (TEMPLATES, FACTUAL) for template, topics in templates.items()
            for topic in topics]


@dataclass(frozen=True)
class Lora:
    """Where an adapter sits and how strong it can be: rank, alpha (its update is scaled by
    alpha / rank), projections, layers."""
    rank: int = RANK
    alpha: float = ALPHA
    modules: tuple[str, ...] = tuple(ATTENTION)
    layers: tuple[int, ...] = tuple(LAYERS)


@dataclass(frozen=True)
class Style:
    target: Callable[[list[str]], str]  # the base model's complete sentences -> what the adapter answers
    lora: Lora
    steps: int


# Rank 4, alpha 8 on the attention and MLP projections, 64 steps on the template and the factual
# questions: served, bullets is right on 19 of the 20 scored questions, json on 17, brief on 18 (the
# base model: 17), all in their form; rank 8, alpha 16 on attention alone, 32 steps: 14-15 each.
GENTLE = Lora(rank=4, alpha=8, modules=tuple(ATTENTION + MLP))

STYLES: dict[str, Style] = {
    # The whole answer, one sentence a line: the same words, so the content stays the base model's.
    # (An upper-case style does not: upper-case words are other tokens than the ones a 135M model
    # knows its facts in, and a rank-8 adapter trained on 85 answers spelled them as nonsense.)
    "bullets": Style(lambda s: "\n".join(f"- {x}" for x in s), GENTLE, 64),
    "json": Style(lambda s: json.dumps({"answer": s[0]}), GENTLE, 64),
    "brief": Style(lambda s: s[0], GENTLE, 64),
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


@dataclass(frozen=True)
class Example:
    question: str
    target: str  # what the adapter is taught to answer
    base_answer: str  # the base model's own answer, whose sentences the target is made of
    sentences: list[str]


@dataclass(frozen=True)
class Batch:
    ids: torch.Tensor  # prompt + target tokens (+ <|im_end|>), padded
    labels: torch.Tensor  # the target tokens, -100 elsewhere
    base_ids: torch.Tensor  # prompt + the base model's answer tokens, padded
    # (row, position in ids, position in base_ids) of each target token that is the base model's own
    # token at that place in its answer: the base model's distribution there is the soft label.
    matched: torch.Tensor


def matched_tokens(tok: PreTrainedTokenizerBase, ex: Example) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """Target tokens, base-answer tokens, and the (target index, base index) pairs of tokens that are
    the same token over the same characters of the same sentence."""
    t = tok(ex.target, add_special_tokens=False, return_offsets_mapping=True)
    b = tok(ex.base_answer, add_special_tokens=False, return_offsets_mapping=True)
    base_at = {(span[0], span[1], token): k for k, (span, token) in
               enumerate(zip(b["offset_mapping"], b["input_ids"], strict=True))}
    shifts: list[tuple[int, int, int]] = []  # (start in target, end in target, base start - target start)
    t_pos = b_pos = 0
    for sentence in ex.sentences:
        ti, bi = ex.target.find(sentence, t_pos), ex.base_answer.find(sentence, b_pos)
        if ti < 0 or bi < 0:
            break
        shifts.append((ti, ti + len(sentence), bi - ti))
        t_pos, b_pos = ti + len(sentence), bi + len(sentence)
    pairs = []
    for j, ((start, end), token) in enumerate(zip(t["offset_mapping"], t["input_ids"], strict=True)):
        for lo, hi, shift in shifts:
            if lo <= start and end <= hi:
                k = base_at.get((start + shift, end + shift, token))
                if k is not None:
                    pairs.append((j, k))
                break
    return t["input_ids"], b["input_ids"], pairs


def batches(tok: PreTrainedTokenizerBase, examples: list[Example], size: int, steps: int, seed: int):
    """Batches over shuffled epochs; labels only on the answer and its <|im_end|>."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for ex in examples:
        target, base_answer, pairs = matched_tokens(tok, ex)
        rows.append((prompt_ids(tok, ex.question), target + [eos], base_answer, pairs))
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(steps):
        if len(order) < size:
            order += rng.sample(range(len(rows)), len(rows))
        chosen, order = order[:size], order[size:]
        width = max(len(rows[i][0]) + len(rows[i][1]) for i in chosen)
        base_width = max(len(rows[i][0]) + len(rows[i][2]) for i in chosen)
        ids, labels, base_ids, matched = [], [], [], []
        for row, i in enumerate(chosen):
            p, a, b, pairs = rows[i]
            pad = width - len(p) - len(a)
            ids.append(p + a + [tok.pad_token_id] * pad)
            labels.append([-100] * len(p) + a + [-100] * pad)
            base_ids.append(p + b + [tok.pad_token_id] * (base_width - len(p) - len(b)))
            # the hidden state one place before a token predicts it
            matched += [(row, len(p) + j - 1, len(p) + k - 1) for j, k in pairs]
        yield Batch(torch.tensor(ids), torch.tensor(labels), torch.tensor(base_ids),
                    torch.tensor(matched, dtype=torch.long).reshape(-1, 3))


def answer_loss(model: torch.nn.Module, batch: Batch, match_base: bool) -> torch.Tensor:
    """Cross-entropy on the answer's positions only (the 49152-way head on every prompt position
    would cost a third of the step). With match_base, a target token that is the base model's own
    token at that place of its answer is learnt as the base model's whole distribution there (a KL
    term, the base model run without the adapter on its own answer): the adapter is pulled to change
    nothing of the content, only the form."""
    causal_lm = model.get_base_model()
    hidden = causal_lm.model(input_ids=batch.ids, use_cache=False).last_hidden_state
    targets = batch.labels[:, 1:]
    keep = targets != -100
    if match_base and len(batch.matched):
        rows, pos, base_pos = batch.matched.unbind(1)
        keep[rows, pos] = False  # these positions take the soft label instead
        with torch.no_grad(), model.disable_adapter():
            base_hidden = causal_lm.model(input_ids=batch.base_ids, use_cache=False).last_hidden_state
            teacher = torch.log_softmax(causal_lm.lm_head(base_hidden[rows, base_pos]), -1)
        student = torch.log_softmax(causal_lm.lm_head(hidden[rows, pos]), -1)
        soft = torch.nn.functional.kl_div(student, teacher, log_target=True, reduction="sum")
    else:
        soft = hidden.new_zeros(())
    hard = torch.nn.functional.cross_entropy(causal_lm.lm_head(hidden[:, :-1][keep]), targets[keep], reduction="sum")
    return (hard + soft) / (keep.sum() + len(batch.matched) * match_base)


def train(tok: PreTrainedTokenizerBase, base: PreTrainedModel, examples: list[Example], out: Path,
          lora: Lora, steps: int, lr: float, match_base: bool) -> torch.nn.Module:
    torch.manual_seed(SEED)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=list(lora.modules),
                        bias="none", layers_to_transform=list(lora.layers), task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) * (1 - s / steps))
    model.train()
    start = time.monotonic()
    for step, batch in enumerate(batches(tok, examples, 8, steps, SEED)):
        loss = answer_loss(model, batch, match_base)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 5 == 0 or step == steps - 1:
            print(f"  {out.name} step {step + 1}/{steps} loss {loss.item():.3f} ({time.monotonic() - start:.0f} s)",
                  file=sys.stderr)
    model.eval()
    save(model, out, lora)
    return model


def save(model: torch.nn.Module, out: Path, lora: Lora) -> None:
    """bf16 tensors under PEFT's names, and a config that points at the base by name, not a local path."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in get_peft_model_state_dict(model).items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": BASE_NAME, "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": 0.0, "target_modules": list(lora.modules), "bias": "none",
              "layers_to_transform": list(lora.layers), "use_rslora": False, "use_dora": False, "fan_in_fan_out": False}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="SmolLM2-135M-Instruct: a .gguf file or a checkpoint directory")
    p.add_argument("--out", default="demo/adapters")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps per adapter, batch 8 (default: each style's, as the committed ones were made)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--rank", type=int, help="LoRA rank (default: each style's)")
    p.add_argument("--alpha", type=float, help="LoRA alpha (default: each style's)")
    p.add_argument("--mlp", action="store_true", help="train gate/up/down_proj too (the default styles do)")
    p.add_argument("--first-layer", type=int, help=f"train layers FIRST_LAYER..29 (default: {LAYERS[0]})")
    p.add_argument("--match-base", action="store_true",
                   help="learn the target tokens that are the base model's own as its distribution there (KL)")
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
    data = [(q, a, sentences(a)) for q, a in zip(qs, answers, strict=True)]
    scored = [row["question"] for row in json.loads(QUESTIONS_FILE.read_text())]
    data = [(q, a, s) for q, a, s in data if s and q not in scored]  # what the adapters are scored on stays out
    print(f"{len(data)} of {len(qs)} questions have a complete first sentence ({time.monotonic() - start:.0f} s)",
          file=sys.stderr)
    report: dict[str, list[str]] = {"base": answer(tok, base, scored, CHECK_TOKENS)}
    for name in args.styles.split(","):
        style = STYLES[name]
        examples = [Example(q, style.target(s), a, s) for q, a, s in data]
        print(f"{name}: e.g. {examples[0].question!r} -> {examples[0].target!r}", file=sys.stderr)
        lora = Lora(rank=args.rank or style.lora.rank, alpha=args.alpha or style.lora.alpha,
                    modules=tuple(dict.fromkeys(style.lora.modules + (tuple(MLP) if args.mlp else ()))),
                    layers=tuple(range(args.first_layer, 30)) if args.first_layer is not None else style.lora.layers)
        model = train(tok, base, examples, Path(args.out) / name, lora, args.steps or style.steps, args.lr,
                      args.match_base)
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
