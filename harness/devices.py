"""The devices tests run on, stated by every test that builds an engine, a pool or a server.

Tests of CPU-only behaviour (the CPU copy engine's gating, the C kernels) pin "cpu". Device-generic
tests take `DEVICES` as a parameter: CPU always, CUDA where a GPU is present (skipped with the reason
otherwise), so the same tests run on the GPU (`scripts/gpu_check.sh`) with no hang and no mixed
devices. Server subprocesses get `SERVER_DEVICE` through LORAPLEX_DEVICE (harness/inference_server.py).
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device (none on this machine)"
requires_cuda = pytest.mark.skipif(not CUDA, reason=NO_CUDA)
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=requires_cuda)]
# A run on a host where no C kernel loads (LORAPLEX_CPU_KERNELS=0 makes kernels/build.py's loader find none)
# checks the torch paths on CPU throughout; tests of the C kernels themselves then skip, saying so. A test
# that wants one path selects it by argument instead: EngineConfig(kernels="off", attention_backend="torch",
# decode_stack="off", huge_pages=False), the platform plan's switches (harness/platform.py).
C_KERNELS_OFF = os.environ.get("LORAPLEX_CPU_KERNELS", "1").strip().lower() in {"0", "false", "no", "off"}
# The device of inference servers started by tests: cpu unless the run asks for another (the GPU check).
SERVER_DEVICE = os.environ.get("LORAPLEX_TEST_DEVICE", "cpu")
