"""Engine throughput: our engine with 16 adapters vs our engine on the base model vs PEFT.

Workload (the same for all three, one process run): 64 requests over 16 adapters of ranks 8
and 16 on all 7 modules, 16 slots, 32-token prompts, 128 new tokens each, greedy, EOS ignored,
a 4-layer hidden-512 LLaMA. PEFT runs its mixed-adapter batch `generate(adapter_names=...)`.
The three runs are interleaved over `--rounds` rounds and each is judged by its best round.
Every run must produce exactly `--new-tokens` tokens for each request, and the engine's tokens must
equal PEFT's (the measured runs' own outputs) on every 8th request, identical in float32; in
bfloat16 two implementations may break a near-tie differently after a few tokens, so there the
first token must agree. Otherwise no RESULT is printed and the exit status is 1.
Last line: RESULT engine_vs_peft_tokens_per_s=<ratio>.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests package: checkpoint and adapter makers

from inference_service.config import EngineConfig
from inference_service.engine import EngineCore
from inference_service.request import Request, SamplingParams
from tests.infra.engine_helpers import load_adapters, run_to_completion
from tests.infra.models import AdapterSpec, make_adapter, make_checkpoint, peft_reference

MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=8, vocab_size=4096, max_position_embeddings=512)


def run_engine(checkpoint: Path, adapters: dict[str, Path], prompts: list[list[int]], names: list[str | None],
               new_tokens: int, dtype: str, device: str) -> tuple[float, list[list[int]]]:
    """Tokens/s, and the generated tokens of each request."""
    core = EngineCore(EngineConfig(model=str(checkpoint), device=device, max_loras=16, max_lora_rank=16,
                                   max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_bytes=256 << 20,
                                   dtype=dtype))
    if adapters:
        load_adapters(core, adapters, preload=True)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        core.add_request(Request(f"r{i}", prompt, params), name)
    outputs = run_to_completion(core, timeout=3600)
    elapsed = time.perf_counter() - start
    tokens = [[t for o in outputs[f"r{i}"] for t in o.new_token_ids] for i in range(len(prompts))]
    core.shutdown()
    return sum(map(len, tokens)) / elapsed, tokens


def run_peft(checkpoint: Path, adapters: dict[str, Path], prompts: list[list[int]], names: list[str],
             new_tokens: int, dtype: str, device: str) -> tuple[float, list[list[int]]]:
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


def compare_with_peft(ours: list[list[int]], peft: list[list[int]], dtype: str) -> list[str]:
    """Problems found comparing our tokens with PEFT's on every 8th request (see the docstring)."""
    sample = range(0, len(ours), 8)
    if dtype == "float32":
        differ = [i for i in sample if ours[i] != peft[i]]
    else:
        differ = [i for i in sample if ours[i][:1] != peft[i][:1]]
    return [f"engine tokens differ from PEFT's ({dtype}) for requests {differ}"] if differ else []


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
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkpoint = make_checkpoint(root / "model", "llama", **MODEL)
        specs = [AdapterSpec(f"ad{i}", 8 if i % 2 else 16, 16, seed=i) for i in range(args.adapters)]
        adapters = {s.name: make_adapter(checkpoint, root / s.name, s) for s in specs}
        gen = torch.Generator().manual_seed(1)
        prompts = torch.randint(3, MODEL["vocab_size"], (args.requests, args.prompt_tokens), generator=gen).tolist()
        names = [specs[i % len(specs)].name for i in range(args.requests)]

        # Rounds interleave the three runs, so that drift in this machine's load hits all alike;
        # each is then judged by its best round.
        ours = base = peft = 0.0
        problems: list[str] = []
        for r in range(args.rounds):
            same = (args.new_tokens, args.dtype, args.device)
            mixed_r, mixed_tokens = run_engine(checkpoint, adapters, prompts, list(names), *same)
            base_r, base_tokens = run_engine(checkpoint, {}, prompts, [None] * args.requests, *same)
            peft_r, peft_tokens = run_peft(checkpoint, adapters, prompts, names, *same)
            for label, tokens in [("engine", mixed_tokens), ("engine, base model", base_tokens),
                                  ("peft", peft_tokens)]:
                problems += check_outputs(f"round {r}, {label}", tokens, args.new_tokens)
            problems += compare_with_peft(mixed_tokens, peft_tokens, args.dtype)
            print(f"round {r}: engine with {args.adapters} adapters {mixed_r:7.1f}, engine on the base model "
                  f"{base_r:7.1f}, peft generate {peft_r:7.1f} tokens/s", flush=True)
            ours, base, peft = max(ours, mixed_r), max(base, base_r), max(peft, peft_r)
    print(f"best of {args.rounds}: engine with {args.adapters} adapters {ours:.1f}, engine on the base model "
          f"{base:.1f}, peft generate {peft:.1f} tokens/s")
    print(f"mixed-adapter / base-model throughput: {ours / base:.3f} (target >= 0.8)")
    if problems:
        sys.exit("no RESULT: the runs' outputs are wrong:\n" + "\n".join(problems))
    print(f"outputs checked: {args.requests} x {args.new_tokens} tokens in each run; the engine's equal PEFT's "
          f"on {len(range(0, args.requests, 8))} sampled requests per round")
    print(f"RESULT engine_vs_peft_tokens_per_s={ours / peft:.3f}")


if __name__ == "__main__":
    main()
