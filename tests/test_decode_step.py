"""The capture-safe decode step (models/decode_step.py, engine/decode_graphs.py) on CPU: its static
buffers give the same tokens as the model's ordinary forward pass, it compiles whole
(torch.compile fullgraph, no graph break: no host sync inside) and the compiled step's tokens and
K/V writes equal the eager step's, for a mixed batch of adapters (ranks over one and two pages, an
adapter in two runs) and base-model rows, with a bucket's padding rows. On CUDA the same step is
captured as a CUDA graph: that test skips here and runs in scripts/gpu_check.sh."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import pytest
import torch

from harness.adapters import write_tiny_adapter
from harness.devices import DEVICES, requires_cuda
from harness.engine_helpers import generate, load_adapters
from harness.platform import plan_for
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore, build_kv_cache, build_lora_manager, default_source
from inference_service.engine.decode_graphs import DecodeGraphs
from inference_service.engine.kv_cache import KVCache
from inference_service.engine.request import SamplingParams
from inference_service.lora.manager import LoRAManager
from inference_service.lora.ops import build_lora_batch
from inference_service.metrics_sink import NullMetrics
from inference_service.models.batch import AttentionBatch, ForwardBatch
from inference_service.models.decode_step import StaticDecodeAttention
from inference_service.models.llama import LlamaModel
from inference_service.models.loader import load_model

# Rows of the step: adapter (None: base model) and context length before the step's token.
ROWS = [("a0", 5), ("a0", 9), (None, 3), ("a1", 12), ("a2", 1), ("a0", 7)]  # a0 twice in a row, then again
RANKS = {"a0": 4, "a1": 8, "a2": 2}  # pages of 4: one page, two pages, half a page
BUCKET = 8  # two padding rows
MAX_BLOCKS = 8


class Setup:
    def __init__(self, device: str, tmp: Path) -> None:
        config = EngineConfig(device=device, max_loras="auto", lora_page_rank=4, max_lora_rank=8,
                              memory_budget_bytes=8 << 20, kv_cache_bytes=2 << 20, block_size=4)
        plan = plan_for(device, torch.float32)
        model, _ = load_model("builtin:tiny", torch.device(device), torch.float32, pack_weights=False,
                              compute=plan.model_compute())
        assert isinstance(model, LlamaModel)
        model.lora_op = plan.make_lora_op()
        self.model = model
        self.lora: LoRAManager = build_lora_manager(config, model, default_source(config, model.config.lora_shapes()),
                                                    NullMetrics(), 8 << 20, plan)
        futures = [self.lora.load_adapter(name, str(write_tiny_adapter(tmp / name, seed=i, rank=rank)), preload=True)
                   for i, (name, rank) in enumerate(RANKS.items())]
        deadline = time.monotonic() + 60
        while not all(f.done() for f in futures):
            assert time.monotonic() < deadline, "adapters did not load in time"
            self.lora.drain()
            time.sleep(0.001)
        for f in futures:
            f.result()
        self.kv: KVCache = build_kv_cache(config, model, 8 << 20, self.lora)
        gen = torch.Generator().manual_seed(0)
        for k, v in self.kv.layers:  # the context: what earlier steps would have written
            k.copy_(torch.randn(k.shape, generator=gen) * 0.5)
            v.copy_(torch.randn(v.shape, generator=gen) * 0.5)
        pad_block, = self.kv.grown([], 1)
        self.pad_slot = pad_block * self.kv.block_size
        # Each sequence's blocks, taken out of order from the pool, room for three more tokens.
        tables = [self.kv.grown([], length + 3) for _, length in ROWS]
        self.tables = [list(reversed(t)) for t in tables]
        self.uids = [self.lora.uid_of(name) if name else None for name, _ in ROWS]
        self.adapters = [(self.lora.pages_of(uid), self.lora.rank_of(uid)) if uid else ((), 0) for uid in self.uids]
        self.tokens = [3 + 17 * i for i in range(len(ROWS))]
        self.positions = [length for _, length in ROWS]

    def graphs(self, mode: str) -> DecodeGraphs:
        return DecodeGraphs(self.model, self.kv.layers, self.kv.block_size, self.lora, MAX_BLOCKS, self.pad_slot,
                            mode, buckets=(BUCKET,))  # type: ignore[arg-type]

    def snapshot(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k.clone(), v.clone()) for k, v in self.kv.layers]

    def restore(self, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for (k, v), (k0, v0) in zip(self.kv.layers, saved, strict=True):
            k.copy_(k0)
            v.copy_(v0)

    def ordinary_step(self, tokens: list[int], positions: list[int]) -> list[int]:
        """The model's own forward pass over a batch built as the model runner builds one."""
        block = self.kv.block_size
        slots = [self.lora.slot_of(uid) if uid else -1 for uid in self.uids]
        pages = {self.lora.slot_of(uid): self.lora.pages_of(uid) for uid in self.uids if uid}
        ranks = {self.lora.slot_of(uid): self.lora.rank_of(uid) for uid in self.uids if uid}
        width = max(len(t) for t in self.tables)
        tensor = torch.tensor
        slot_mapping = [t[p // block] * block + p % block for t, p in zip(self.tables, positions, strict=True)]
        attention = AttentionBatch(
            slot_mapping=tensor(slot_mapping),
            decode_rows=torch.arange(len(tokens)), decode_block_tables=tensor([t + [0] * (width - len(t))
                                                                               for t in self.tables]),
            decode_lens=tensor([p + 1 for p in positions]))
        lora = build_lora_batch(slots, pages, ranks, self.lora.page_rank, self.lora.zero_page, self.model.device)
        batch = ForwardBatch(tensor(tokens), tensor(positions), attention, lora, torch.arange(len(tokens)))
        with torch.inference_mode():
            return self.model.logits(self.model.hidden(batch, self.kv.layers)).argmax(-1).tolist()

    def decode(self, graphs: DecodeGraphs, steps: int) -> list[list[int]]:
        tokens, positions, out = list(self.tokens), list(self.positions), []
        for _ in range(steps):
            tokens = graphs.run(tokens, positions, self.tables, self.adapters).tolist()
            out.append(tokens)
            positions = [p + 1 for p in positions]
        return out


@pytest.fixture(scope="module")
def cpu_setup(tmp_path_factory) -> Setup:
    return Setup("cpu", tmp_path_factory.mktemp("adapters"))


def test_static_step_matches_the_ordinary_forward(cpu_setup: Setup):
    """Same tokens as the model's forward over the runner-built batch, for two steps in a row (the
    second reads the K/V the first wrote); base-model rows and padding rows change nothing."""
    s = cpu_setup
    saved = s.snapshot()
    expected, tokens, positions = [], list(s.tokens), list(s.positions)
    for _ in range(2):
        tokens = s.ordinary_step(tokens, positions)
        expected.append(tokens)
        positions = [p + 1 for p in positions]
    s.restore(saved)
    assert s.decode(s.graphs("eager"), 2) == expected
    s.restore(saved)


def _break_reasons(setup: Setup) -> list[str]:
    """Why dynamo could not trace the bucket's step as one graph ([] if it could)."""
    graphs = setup.graphs("eager")
    graphs.inputs.fill(setup.tokens, setup.positions, setup.tables, setup.kv.block_size)
    setup.lora.fill_step_buffers(setup.adapters)
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(graphs.body(BUCKET))()
    return [str(reason.reason) for reason in explained.break_reasons] + (
        [f"{explained.graph_count} graphs"] if explained.graph_count != 1 else [])


def test_step_has_no_host_sync(cpu_setup: Setup):
    """Dynamo traces the whole step as one graph: no .item(), .tolist() or value-dependent branch."""
    saved = cpu_setup.snapshot()
    assert _break_reasons(cpu_setup) == []
    cpu_setup.restore(saved)


def test_a_host_sync_in_the_step_is_caught(cpu_setup: Setup, monkeypatch):
    """The check above would fail if anyone added a host sync to the step (here: attention reading
    the longest sequence's length back to the host)."""
    original = StaticDecodeAttention.decode

    def syncing(self, q, k_cache, v_cache, tables, lens):
        longest = int(lens.max().item())
        return original(self, q, k_cache, v_cache, tables[:, : -(-longest // k_cache.shape[1])], lens)

    monkeypatch.setattr(StaticDecodeAttention, "decode", syncing)
    saved = cpu_setup.snapshot()
    assert _break_reasons(cpu_setup) != []
    cpu_setup.restore(saved)


@pytest.mark.slow
def test_compiled_step_equals_eager(cpu_setup: Setup):
    """torch.compile(fullgraph=True, dynamic=False) of the bucket's step: tokens and K/V writes equal
    the eager step's over three steps (fullgraph raises on any graph break)."""
    s = cpu_setup
    saved = s.snapshot()
    eager_tokens = s.decode(s.graphs("eager"), 3)
    eager_kv = s.snapshot()
    s.restore(saved)
    torch._dynamo.reset()
    compiled_tokens = s.decode(s.graphs("compile"), 3)
    assert compiled_tokens == eager_tokens
    for (k, v), (k0, v0) in zip(s.kv.layers, eager_kv, strict=True):
        torch.testing.assert_close(k, k0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v0, atol=1e-5, rtol=1e-5)
    s.restore(saved)


@requires_cuda
def test_cuda_graph_replay_equals_eager(tmp_path: Path):
    """On a GPU: the bucket's step captured in a CUDA graph and replayed gives the eager step's tokens
    (scripts/gpu_check.sh runs it; skipped without CUDA)."""
    s = Setup("cuda", tmp_path)
    saved = s.snapshot()
    eager_tokens = s.decode(s.graphs("eager"), 3)
    s.restore(saved)
    assert s.decode(s.graphs("cuda_graph"), 3) == eager_tokens


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_engine_with_captured_decode_matches_uncaptured(device: str, tmp_path: Path):
    """The engine's greedy decode steps through the captured step (compiled on CPU, a CUDA graph
    on CUDA) generate the tokens the uncaptured engine does, and leave nothing held."""
    adapters = {f"a{i}": write_tiny_adapter(tmp_path / f"a{i}", rank=4 + 2 * i, seed=i) for i in range(3)}
    prompts = {f"r{i}": ([256, 72 + i, 101, 108], name) for i, name in enumerate([*adapters, None])}
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    generated = {}
    for graphs in ("off", "on"):
        core = EngineCore(EngineConfig(device=device, max_loras=4, max_lora_rank=8, kv_cache_bytes=4 << 20,
                                       max_num_seqs=8, decode_graphs=graphs))
        load_adapters(core, adapters)
        generated[graphs] = generate(core, prompts, params)
        if graphs == "on":
            assert core.runner.graphs is not None and 4 in core.runner.graphs.captured  # the whole batch's steps
        assert core.runner.kv.num_used == 0 and core.lora.stats().references == 0
        core.shutdown()
    assert generated["on"] == generated["off"]


def test_manager_logs_free_memory_on_load_and_unload(cpu_setup: Setup, tmp_path: Path, caplog):
    """The LoRA manager's load and unload lines give the free memory where its buffers live (the
    host's MemAvailable on CPU, the device's on CUDA)."""
    lora = cpu_setup.lora
    with caplog.at_level(logging.INFO, logger="inference_service.lora.manager"):
        future = lora.load_adapter("logged", str(write_tiny_adapter(tmp_path / "logged", seed=9)))
        deadline = time.monotonic() + 60
        while not future.done():
            assert time.monotonic() < deadline, "the adapter did not register in time"
            lora.drain()
            time.sleep(0.001)
        unloaded = lora.unload_adapter("logged")
        while not unloaded.done():
            assert time.monotonic() < deadline, "the adapter did not unload in time"
            lora.drain()
            time.sleep(0.001)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("load adapter logged",
                                                                                 "unload adapter logged"))]
    assert len(lines) == 2, lines
    for line in lines:
        match = re.search(r"([0-9.]+) GiB host memory free", line)
        assert match and float(match.group(1)) > 0, line
