"""The platform plan (inference_service/platform): chosen once at start-up from the switches, the
CPU's flags and the kernels that load; the switches select a path by argument; the server logs the
plan as one table and shows it in GetModelInfo and the `loraplex_platform_info` gauge."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from adapter_cache.errors import FailedPreconditionError
from harness.devices import C_KERNELS_OFF
from harness.inference_server import ROOT
from harness.platform import plan_for
from inference_service.api import inference_pb2 as pb
from inference_service.client import InferenceClient
from inference_service.frontend.platform_info import label_name
from inference_service.lora.ops import TorchLoRAOp
from inference_service.models.attention import CpuPagedAttention, TorchPagedAttention
from inference_service.models.fused_ops import CFusedOps, TorchFusedOps

KEYS = ["device", "cpu", "cpu flags", "kernels", "dtype", "linear packing", "quantized weights", "attention decode",
        "attention prefill", "lora op", "fused ops", "greedy pick", "decode stack", "copy engine", "huge pages",
        "memory budget"]


def test_kernels_off_selects_every_torch_path():
    plan = plan_for("cpu", torch.float32, kernels="off")
    compute = plan.model_compute()
    assert isinstance(compute.attention, TorchPagedAttention) and not isinstance(compute.attention, CpuPagedAttention)
    assert isinstance(compute.fused, TorchFusedOps) and isinstance(plan.make_lora_op(), TorchLoRAOp)
    assert plan.packing.forms == ("onednn",) and not plan.packing.quantized
    rows = dict(plan.rows())
    assert rows["kernels"] == "off (--kernels off)" and rows["decode stack"] == "off (--kernels off)"
    assert [key for key, _ in plan.rows()] == KEYS


@pytest.mark.skipif(C_KERNELS_OFF, reason="the C kernels are turned off in this run (LORAPLEX_CPU_KERNELS)")
def test_the_attention_backend_is_chosen_by_name():
    auto = plan_for("cpu", torch.float32)
    assert auto.attention == "c" and isinstance(auto.model_compute().attention, CpuPagedAttention)
    assert isinstance(auto.model_compute().fused, CFusedOps)
    named = plan_for("cpu", torch.float32, attention_backend="torch")
    assert named.attention == "torch" and type(named.model_compute().attention) is TorchPagedAttention
    assert named.lora_op == auto.lora_op == "c"  # only the attention changed
    assert dict(named.rows())["attention prefill"] == "torch SDPA"


@pytest.mark.parametrize(("settings", "message"), [
    ({"attention_backend": "triton"}, "--attention-backend triton does not run on cpu: it needs CUDA and triton"),
    ({"attention_backend": "c", "kernels": "off"}, "--attention-backend c does not run on cpu: it needs the C kernels"),
    ({"attention_backend": "flash"}, "--attention-backend must be one of auto, c, triton, torch, got 'flash'"),
    ({"kernels": "maybe"}, "--kernels must be one of auto, off, got 'maybe'"),
])
def test_a_path_that_cannot_run_here_is_refused_not_replaced(settings, message):
    with pytest.raises(FailedPreconditionError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        plan_for("cpu", torch.float32, **settings)


def test_the_server_logs_and_reports_the_plan_it_follows(inference_server_factory):
    """`--kernels off --attention-backend torch --decode-stack off --huge-pages off`: the start-up log's
    table, GetModelInfo's rows and the gauge's labels all say so, and the server generates."""
    server = inference_server_factory("--kernels", "off", "--attention-backend", "torch", "--decode-stack", "off",
                                      "--huge-pages", "off")
    with InferenceClient(server.address) as client:
        info = client.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        tokens = [t for d in client.generate([3, 4, 5], max_new_tokens=4, timeout=60) for t in d.token_ids]
    assert len(tokens) == 4
    rows = {row.key: row.value for row in info.platform}
    assert [row.key for row in info.platform] == KEYS
    assert rows["kernels"] == "off (--kernels off)" and rows["attention decode"] == "torch"
    assert rows["lora op"] == "torch" and rows["fused ops"] == "torch" and rows["greedy pick"] == "torch"
    assert rows["huge pages"] == "off"
    assert rows["decode stack"] == "off (--decode-stack off)" and rows["dtype"] == "float32 (--dtype)"
    log = server.log()
    assert "platform plan:" in log
    for key, value in rows.items():
        assert f"  {key:<17}  {value}" in log  # one table, one row per choice
    labels = {label_name(key): value for key, value in rows.items()}
    assert server.value("loraplex_platform_info", **labels) == 1


def test_a_backend_absent_here_stops_the_server_with_a_clear_message():
    result = subprocess.run(
        [sys.executable, "-m", "inference_service.cli", "--model", "builtin:tiny", "--device", "cpu",
         "--listen", "127.0.0.1:0", "--http-port", "0", "--attention-backend", "triton"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "--attention-backend triton does not run on cpu: it needs CUDA and triton" in result.stderr
