"""Engine throughput: our engine with 16 adapters vs our engine on the base model vs PEFT.

Workload (the same for all three, one process run): 64 requests over 16 adapters of ranks 8
and 16 on all 7 modules, 16 slots, 32-token prompts, 128 new tokens each, greedy, EOS ignored,
a 4-layer hidden-512 LLaMA. PEFT runs its mixed-adapter batch `generate(adapter_names=...)`.
The three runs are interleaved over `--rounds` rounds and each is judged by its best round.
Every run must produce exactly `--new-tokens` tokens for each request, and every request's tokens
(so every adapter: ranks 8 and 16, scalings 1 to 3) are judged by PEFT in float32, teacher-forced on
them: a token's shortfall is how far its logit lies below PEFT's best given the same context. In
float32 each of the engine's tokens must fall short by at most 2 x 1e-4 (a near-tie either way:
were its logits within 1e-4 of PEFT's, as tests/test_engine_vs_peft.py holds, its argmax would be).
In bfloat16 single logits move by up to ~1 (random weights, flat logits), so single tokens tell
nothing; each request's mean shortfall must be at most HALF_FACTOR x the largest of PEFT's own in
bfloat16 (the measured PEFT run's tokens): measured, the engine's 0.04 against PEFT's 0.09, while
wrong adapters or none fall short by 1.6 or more. Otherwise no RESULT is printed and the exit
status is 1.
`--model` runs the same on a real model (a .gguf file or a checkpoint directory) with random adapters
of its shapes; `--max-loras` sets the engine's slots (fewer than adapters: slots are reused);
`--moe` makes the random model a Qwen3-MoE one (8 experts, top-2). On an MoE model the adapters
target attention and every expert, and PEFT (0.21) cannot run a batch of mixed adapters on its
wrapped expert parameters: its baseline is then per adapter, each adapter's requests one batch on a
PeftModel of that adapter alone, the times summed (and the tokens judged the same way).
Last line: RESULT engine_vs_peft_tokens_per_s=<ratio>.

`--compare cuda-graph,triton-lora` (CUDA only) runs, instead of the PEFT comparison, our engine
against itself with one thing changed, interleaved over the rounds, best round each:
- cuda-graph: greedy decode steps replayed from CUDA graphs vs the same engine uncaptured
  (EngineConfig.decode_graphs on/off); both run the same kernels, so their tokens must be equal;
- triton-lora: the Triton LoRA kernels vs torch's batched matmuls (EngineConfig.triton_kernels);
  the tokens of requests where they differ are counted and printed (float sums in another order).
Lines: RESULT cuda_graph_vs_eager=<tokens/s ratio>, RESULT triton_lora_vs_torch_op=<ratio>.
The in-process engine as an embedder gets it (EngineCore with its defaults: detokenize=True, text
decoded when read) runs beside the server-style configuration (detokenize=False: the server's engine,
whose front end decodes) on the base-model workload in every round, the two taking turns to go
first; each default run's text is then read and checked against the decode of its ids. RESULT
inprocess_default_vs_server_engine=<best default tok/s / best server-style tok/s> (target >= 0.95).
`--no-peft` runs only the engine's runs, on a .gguf --model as the server loads it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

# isort: off
import inference_service  # noqa: F401 - first: the server's OpenMP settings, before torch loads libgomp
import torch
# isort: on


from harness.bench import ENGINE_MODEL, print_result
from harness.engine_helpers import load_adapters, run_to_completion
from harness.models import AdapterSpec, make_adapter, make_checkpoint, peft_reference
from harness.real_model import reference_checkpoint
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import Request, SamplingParams

MODEL = ENGINE_MODEL


MAX_RANK = 16  # the adapters' largest rank (ranks 8 and 16): the engine's max_lora_rank


def run_engine(checkpoint: Path, adapters: dict[str, Path], prompts: list[list[int]], names: list[str | None],
               new_tokens: int, dtype: str, device: str, max_loras: int | str = 16,
               detokenize: bool = True, **config: object) -> tuple[float, list[list[int]]]:
    """Tokens/s, and the generated tokens of each request. `detokenize`: EngineCore's (True, its
    default: what an embedder gets; False: the server's engine); `config`: more EngineConfig fields."""
    core = EngineCore(EngineConfig(model=str(checkpoint), device=device, max_loras=max_loras, max_lora_rank=MAX_RANK,
                                   max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_bytes=256 << 20,
                                   dtype=dtype, **config), detokenize=detokenize)  # type: ignore[arg-type]
    if adapters:
        load_adapters(core, adapters, preload=True)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        core.add_request(Request(f"r{i}", prompt, params), name)
    outputs = run_to_completion(core, timeout=3600)
    elapsed = time.perf_counter() - start
    tokens = [[t for o in outputs[f"r{i}"] for t in o.new_token_ids] for i in range(len(prompts))]
    if detokenize:  # the embedder's text, read after the run (off the engine's steps): it must be the decode
        texts = ["".join(o.text or "" for o in outputs[f"r{i}"]) for i in range(len(prompts))]
        wrong = [i for i, (text, ids) in enumerate(zip(texts, tokens, strict=True))
                 if text != core.tokenizer.decode(ids)]
        if wrong:
            sys.exit(f"no RESULT: requests {wrong[:8]}'s text is not the decode of their ids")
    core.shutdown()
    return sum(map(len, tokens)) / elapsed, tokens


class PerAdapterPeft:
    """PEFT one adapter at a time (one PeftModel each): an MoE model's baseline, as PEFT cannot batch
    mixed adapters on wrapped expert parameters. Called like a PeftModel with `adapter_names`, each
    adapter's rows run as their own batch; `generate` returns the summed time of those batches."""

    def __init__(self, checkpoint: Path, adapters: dict[str, Path], device: str, dtype: torch.dtype) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        self.models = {name: PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32), str(path)
        ).to(device=device, dtype=dtype).eval() for name, path in adapters.items()}

    def _groups(self, names: list[str]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for row, name in enumerate(names):
            groups.setdefault(name, []).append(row)
        return groups

    def __call__(self, input_ids: torch.Tensor, adapter_names: list[str]):  # noqa: ANN204 - a model output
        logits = None
        for name, rows in self._groups(adapter_names).items():
            part = self.models[name](input_ids=input_ids[rows]).logits
            logits = part.new_empty(input_ids.shape[0], *part.shape[1:]) if logits is None else logits
            logits[rows] = part
        return argparse.Namespace(logits=logits)

    def generate(self, inputs: torch.Tensor, names: list[str], new_tokens: int) -> tuple[float, list[list[int]]]:
        tokens: list[list[int]] = [[] for _ in names]
        elapsed = 0.0
        for name, rows in self._groups(names).items():
            batch = inputs[rows]
            start = time.perf_counter()
            out = self.models[name].generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=new_tokens,
                                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            if batch.device.type != "cpu":
                torch.cuda.synchronize()
            elapsed += time.perf_counter() - start
            for row, generated in zip(rows, out[:, batch.shape[1]:].tolist(), strict=True):
                tokens[row] = generated
        return sum(map(len, tokens)) / elapsed, tokens


def run_peft(checkpoint: Path, adapters: dict[str, Path], prompts: list[list[int]], names: list[str],
             new_tokens: int, dtype: str, device: str) -> tuple[float, list[list[int]]]:
    if is_moe(checkpoint):
        per_adapter = PerAdapterPeft(checkpoint, adapters, device, getattr(torch, dtype))
        return per_adapter.generate(torch.tensor(prompts, device=device), names, new_tokens)
    model = peft_reference(checkpoint, adapters).to(device=device, dtype=getattr(torch, dtype))
    inputs = torch.tensor(prompts, device=device)
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), adapter_names=names,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if device != "cpu":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    tokens = out[:, inputs.shape[1]:].tolist()
    return sum(map(len, tokens)) / elapsed, tokens


def check_outputs(label: str, tokens: list[list[int]], new_tokens: int) -> list[str]:
    """Problems with one run's outputs: every request must have exactly `new_tokens` tokens."""
    wrong = [i for i, t in enumerate(tokens) if len(t) != new_tokens]
    return [f"{label}: requests {wrong[:8]} did not produce {new_tokens} tokens"] if wrong else []


FP32_TOL = 1e-4
HALF_FACTOR = 2.5  # tests/test_engine_vs_peft.py's factor over PEFT's own half-precision error


def shortfalls(reference, prompts: list[list[int]], names: list[str], generated: list[list[int]],
               device: str, chunk: int = 8) -> list[torch.Tensor]:
    """Per request and generated token: how far its logit lies below the best of `reference`'s
    (PEFT, float32) given the prompt and the tokens before it. Requests are all one length: batched."""
    out: list[torch.Tensor] = []
    with torch.no_grad():
        for at in range(0, len(prompts), chunk):
            tokens = generated[at:at + chunk]
            ids = torch.tensor([p + g[:-1] for p, g in zip(prompts[at:at + chunk], tokens, strict=True)],
                               device=device)
            logits = reference(input_ids=ids, adapter_names=names[at:at + chunk]).logits.float()
            logits = logits[:, len(prompts[0]) - 1:]
            chosen = logits.gather(2, torch.tensor(tokens, device=device).unsqueeze(2)).squeeze(2)
            out += list((logits.max(dim=2).values - chosen).cpu())
    return out


def compare_with_peft(checkpoint: Path, adapters: dict[str, Path], prompts: list[list[int]], names: list[str],
                      ours: list[list[int]], peft: list[list[int]], dtype: str, device: str) -> list[str]:
    """Problems found judging every request's tokens by PEFT's float32 logits (see the docstring)."""
    reference = (PerAdapterPeft(checkpoint, adapters, device, torch.float32) if is_moe(checkpoint)
                 else peft_reference(checkpoint, adapters).to(device=device))
    ours_short = shortfalls(reference, prompts, names, ours, device)
    if dtype == "float32":
        return [f"request {i} ({names[i]}): token {int(s.argmax())} is {s.max():.2e} below PEFT's best logit "
                f"given the same context (allowed {2 * FP32_TOL:.0e})"
                for i, s in enumerate(ours_short) if s.max() > 2 * FP32_TOL]
    bound = HALF_FACTOR * max(s.mean().item() for s in shortfalls(reference, prompts, names, peft, device))
    print(f"mean shortfall per request ({dtype}): engine at most {max(s.mean().item() for s in ours_short):.4f}, "
          f"bound {bound:.4f} ({HALF_FACTOR} x PEFT's own largest)")
    return [f"request {i} ({names[i]}): its tokens fall {s.mean():.4f} below PEFT's best logit on average "
            f"(allowed {bound:.4f}, {dtype})" for i, s in enumerate(ours_short) if s.mean() > bound]


# --compare: name -> (RESULT name, the measured engine's config, the baseline's, tokens must be equal)
COMPARISONS: dict[str, tuple[str, dict[str, object], dict[str, object], bool]] = {
    "cuda-graph": ("cuda_graph_vs_eager", {"decode_graphs": "on"}, {"decode_graphs": "off"}, True),
    "triton-lora": ("triton_lora_vs_torch_op", {"triton_kernels": True}, {"triton_kernels": False}, False),
}


def run_comparisons(names_to_run: list[str], checkpoint: Path, adapters: dict[str, Path], prompts: list[list[int]],
                    names: list[str], args: argparse.Namespace) -> None:
    """Each comparison's two engines interleaved over the rounds; a RESULT line each whose outputs
    are right (full length; equal where they must be)."""
    same = (args.new_tokens, args.dtype, args.device, args.max_loras)
    best: dict[str, list[float]] = {name: [0.0, 0.0] for name in names_to_run}
    problems: list[str] = []
    for r in range(args.rounds):
        for name in names_to_run:
            _, measured, baseline, must_equal = COMPARISONS[name]
            rate, tokens = run_engine(checkpoint, adapters, prompts, list(names), *same, **measured)
            base_rate, base_tokens = run_engine(checkpoint, adapters, prompts, list(names), *same, **baseline)
            for label, output in ((f"{name} {measured}", tokens), (f"{name} {baseline}", base_tokens)):
                problems += check_outputs(f"round {r}, {label}", output, args.new_tokens)
            differ = sum(a != b for a, b in zip(tokens, base_tokens, strict=True))
            if must_equal and differ:
                problems.append(f"round {r}, {name}: {differ} of {len(prompts)} requests generated other tokens")
            print(f"round {r}: {name}: {rate:7.1f} vs {base_rate:7.1f} tokens/s ({measured} vs {baseline}); "
                  f"{differ} of {len(prompts)} requests differ", flush=True)
            best[name] = [max(best[name][0], rate), max(best[name][1], base_rate)]
    if problems:
        sys.exit("no RESULT: the runs' outputs are wrong:\n" + "\n".join(problems))
    for name in names_to_run:
        print_result(COMPARISONS[name][0], best[name][0] / best[name][1])


def is_moe(checkpoint: Path) -> bool:
    config = json.loads((checkpoint / "config.json").read_text())
    return bool(config.get("num_experts") or config.get("num_local_experts"))


def bench_checkpoint(model: str, root: Path, moe: bool = False) -> Path:
    """The checkpoint directory both sides load: --model's, a .gguf dequantized into one (by
    transformers, so the engine and PEFT run the same weights), or a random one (`moe`: Qwen3-MoE)."""
    if not model:
        family, shape = ("qwen3_moe", dict(MODEL, moe_intermediate_size=MODEL["hidden_size"] // 2,
                                           head_dim=64)) if moe else ("llama", MODEL)
        return make_checkpoint(root / "model", family, **shape)
    path = Path(model)
    return reference_checkpoint(path, root / "model") if path.suffix == ".gguf" else path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of each; the best counts")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights and activations, the same for all three runs")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N, the same for all three runs")
    parser.add_argument("--model", default="", help="a .gguf file or a Hugging Face checkpoint directory "
                        "(default: a random 4-layer hidden-512 LLaMA)")
    parser.add_argument("--moe", action="store_true", help="without --model: a random Qwen3-MoE model")
    parser.add_argument("--ranks", default="8,16", help="the adapters' ranks, taken in turn")
    parser.add_argument("--max-loras", type=lambda v: v if v == "auto" else int(v), default=16,
                        help="the engine's adapter pool: a count of slots, or auto (sized by memory)")
    parser.add_argument("--compare", default="", help="instead of PEFT, on CUDA: comma-separated of "
                        f"{', '.join(COMPARISONS)} (captured decode vs eager, Triton LoRA vs the torch op)")
    parser.add_argument("--no-peft", action="store_true", help="only the engine's runs (no PEFT, no "
                        "engine_vs_peft RESULT): the in-process default vs server-style comparison")
    args = parser.parse_args()
    comparisons = [name for name in args.compare.split(",") if name]
    unknown = [name for name in comparisons if name not in COMPARISONS]
    if unknown:
        parser.error(f"--compare: unknown {unknown}; known: {', '.join(COMPARISONS)}")
    if comparisons and not args.device.startswith("cuda"):
        sys.exit(f"--compare {args.compare} needs CUDA (--device cuda): CUDA graphs and the Triton kernels run "
                 "only there")
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkpoint = bench_checkpoint(args.model, root, args.moe)
        # Without PEFT nothing needs the dequantized copy: the engine serves the .gguf itself (with its
        # own tokenizer, whose text the default runs read), as `loraplex-inference --model` would.
        engine_model = Path(args.model) if args.no_peft and args.model.endswith(".gguf") else checkpoint
        vocab_size = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        # ranks 8 and 16 by default, alphas 16 and 24: scalings 1, 1.5, 2 and 3; on an MoE model the
        # expert projections named as modules, which PEFT targets on every expert (target_parameters)
        ranks = [int(r) for r in args.ranks.split(",")]
        global MAX_RANK
        # PEFT saves an MoE adapter's gate and up (named as modules) as one gate_up of twice the rank
        MAX_RANK = max(ranks) * (2 if is_moe(checkpoint) else 1)
        specs = [AdapterSpec(f"ad{i}", ranks[(i + 1) % len(ranks)], 16 if i % 4 < 2 else 24, seed=i)
                 for i in range(args.adapters)]
        adapters = {s.name: make_adapter(checkpoint, root / s.name, s) for s in specs}
        gen = torch.Generator().manual_seed(1)
        prompts = torch.randint(3, vocab_size, (args.requests, args.prompt_tokens), generator=gen).tolist()
        names = [specs[i % len(specs)].name for i in range(args.requests)]
        if comparisons:
            run_comparisons(comparisons, checkpoint, adapters, prompts, names, args)
            return

        # Rounds interleave the three runs, so that drift in this machine's load hits all alike;
        # each is then judged by its best round.
        ours = base = peft = server = 0.0
        problems: list[str] = []
        for r in range(args.rounds):
            same = (args.new_tokens, args.dtype, args.device)
            mixed_r, mixed_tokens = run_engine(engine_model, adapters, prompts, list(names), *same, args.max_loras)
            base_run = (engine_model, {}, prompts, [None] * args.requests, *same, args.max_loras)
            if r % 2 == 0:  # the two in-process configurations take turns to go first
                base_r, base_tokens = run_engine(*base_run)
                server_r, server_tokens = run_engine(*base_run, detokenize=False)
            else:
                server_r, server_tokens = run_engine(*base_run, detokenize=False)
                base_r, base_tokens = run_engine(*base_run)
            runs = [("engine", mixed_tokens), ("engine, base model", base_tokens),
                    ("engine, base model, server-style", server_tokens)]
            if server_tokens != base_tokens:
                problems.append(f"round {r}: the server-style run generated other tokens than the default one")
            peft_r = 0.0
            if not args.no_peft:
                peft_r, peft_tokens = run_peft(checkpoint, adapters, prompts, names, *same)
                runs.append(("peft", peft_tokens))
                problems += compare_with_peft(checkpoint, adapters, prompts, names, mixed_tokens, peft_tokens,
                                              *same[1:])
                same_as_generate = sum(a == b for a, b in zip(mixed_tokens, peft_tokens, strict=True))
                print(f"round {r}: {same_as_generate} of {args.requests} requests generated exactly PEFT's tokens")
            for label, tokens in runs:
                problems += check_outputs(f"round {r}, {label}", tokens, args.new_tokens)
            print(f"round {r}: engine with {args.adapters} adapters {mixed_r:7.1f}, engine on the base model "
                  f"{base_r:7.1f} (defaults) / {server_r:7.1f} (server-style), peft generate {peft_r:7.1f} tokens/s",
                  flush=True)
            ours, base, peft, server = max(ours, mixed_r), max(base, base_r), max(peft, peft_r), max(server, server_r)
    print(f"best of {args.rounds}: engine with {args.adapters} adapters {ours:.1f}, engine on the base model "
          f"{base:.1f} (defaults) / {server:.1f} (server-style), peft generate {peft:.1f} tokens/s")
    print(f"mixed-adapter / base-model throughput: {ours / base:.3f} (target >= 0.8)")
    if problems:
        sys.exit("no RESULT: the runs' outputs are wrong:\n" + "\n".join(problems))
    print_result("inprocess_default_vs_server_engine", base / server)
    if args.no_peft:
        return
    print(f"outputs checked: {args.requests} x {args.new_tokens} tokens in each run; every request's tokens "
          f"judged by PEFT's logits given the same context ({args.dtype})")
    print_result("engine_vs_peft_tokens_per_s", ours / peft)


if __name__ == "__main__":
    main()
