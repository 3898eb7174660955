"""The package sets OpenMP's wait policy to PASSIVE before torch loads, unless the operator chose one
(inference_service/__init__.py says why)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.inference_server import ROOT

PROBE = "import inference_service, torch, os; print(os.environ.get('OMP_WAIT_POLICY'))"


@pytest.mark.parametrize(("env", "expected"), [
    ({}, "PASSIVE"),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),
    ({"GOMP_SPINCOUNT": "10000"}, "None"),  # the operator tuned spinning: left alone
])
def test_wait_policy_defaults_to_passive(env, expected):
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == expected
