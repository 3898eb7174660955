"""Engine throughput: our engine with 16 adapters vs our engine on the base model vs PEFT.

Workload (the same for all three, one process run): 64 requests over 16 adapters of ranks 8
and 16 on all 7 modules, 16 slots, 32-token prompts, 128 new tokens each, greedy, EOS ignored,
a 4-layer hidden-512 LLaMA. PEFT runs its mixed-adapter batch `generate(adapter_names=...)`.
The three runs are interleaved over `--rounds` rounds and each is judged by its best round.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the harness package: checkpoint and adapter makers

from harness.engine_helpers import load_adapters, run_to_completion
from harness.models import AdapterSpec, make_adapter, make_checkpoint, peft_reference
from inference_service.config import EngineConfig
from inference_service.engine_core import EngineCore
from inference_service.request import Request, SamplingParams

MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=8, vocab_size=4096, max_position_embeddings=512)


def run_engine(checkpoint: Path, adapters: dict[str, Path], prompts: list[list[int]], names: list[str | None],
               new_tokens: int, dtype: str) -> float:
    core = EngineCore(EngineConfig(model=str(checkpoint), max_loras=16, max_lora_rank=16, max_num_seqs=64,
                                   max_num_batched_tokens=2048, kv_cache_bytes=256 << 20, dtype=dtype))
    if adapters:
        load_adapters(core, adapters, preload=True)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        core.add_request(Request(f"r{i}", prompt, params), name)
    outputs = run_to_completion(core, timeout=3600)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.new_token_ids) for outs in outputs.values() for o in outs)
    assert generated == len(prompts) * new_tokens
    core.shutdown()
    return generated / elapsed


def run_peft(checkpoint: Path, adapters: dict[str, Path], prompts: list[list[int]], names: list[str],
             new_tokens: int, dtype: str) -> float:
    model = peft_reference(checkpoint, adapters).to(getattr(torch, dtype))
    inputs = torch.tensor(prompts)
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), adapter_names=names,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - start
    generated = (out.shape[1] - inputs.shape[1]) * out.shape[0]
    return generated / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of each; the best counts")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights and activations, the same for all three runs")
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
        for r in range(args.rounds):
            mixed_r = run_engine(checkpoint, adapters, prompts, list(names), args.new_tokens, args.dtype)
            base_r = run_engine(checkpoint, {}, prompts, [None] * args.requests, args.new_tokens, args.dtype)
            peft_r = run_peft(checkpoint, adapters, prompts, names, args.new_tokens, args.dtype)
            print(f"round {r}: engine with {args.adapters} adapters {mixed_r:7.1f}, engine on the base model "
                  f"{base_r:7.1f}, peft generate {peft_r:7.1f} tokens/s", flush=True)
            ours, base, peft = max(ours, mixed_r), max(base, base_r), max(peft, peft_r)
    print(f"best of {args.rounds}: engine with {args.adapters} adapters {ours:.1f}, engine on the base model "
          f"{base:.1f}, peft generate {peft:.1f} tokens/s")
    print(f"mixed-adapter / base-model throughput: {ours / base:.3f} (target >= 0.8)")
    print(f"RESULT engine_vs_peft_tokens_per_s={ours / peft:.3f}")


if __name__ == "__main__":
    main()
