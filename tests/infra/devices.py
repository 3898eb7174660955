"""The devices tests run on, stated by every test that builds an engine, a pool or a server.

Tests of CPU-only behaviour (the CPU copy engine's gating, the C kernels) pin "cpu". Device-generic
tests take `DEVICES` as a parameter: CPU always, CUDA where a GPU is present (skipped with the reason
otherwise), so the same tests run on the GPU (`scripts/gpu_check.sh`) with no hang and no mixed
devices. Server subprocesses get `SERVER_DEVICE` through LORAPLEX_DEVICE (tests/infra/inference_server.py).
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device (none on this machine)"
requires_cuda = pytest.mark.skipif(not CUDA, reason=NO_CUDA)
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=requires_cuda)]
# A run with the C kernels turned off (LORAPLEX_CPU_KERNELS=0, kernels/build.py) checks the torch paths on
# CPU; tests of the C kernels themselves then skip, saying so.
C_KERNELS_OFF = os.environ.get("LORAPLEX_CPU_KERNELS", "1").strip().lower() in {"0", "false", "no", "off"}
# The device of inference servers started by tests: cpu unless the run asks for another (the GPU check).
SERVER_DEVICE = os.environ.get("LORAPLEX_TEST_DEVICE", "cpu")
