"""The package sets how long OpenMP threads spin at a barrier (GOMP_SPINCOUNT=1000) before torch loads,
unless the operator chose (inference_service/__init__.py says why), and says when it came too late."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.inference_server import ROOT

PROBE = ("import inference_service, torch, os; print(os.environ.get('OMP_WAIT_POLICY'), "
         "os.environ.get('GOMP_SPINCOUNT'), inference_service.openmp_wait_policy(), sep='|')")


def probe(env: dict[str, str], code: str = PROBE) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.strip().split("|")


@pytest.mark.parametrize(("env", "expected"), [
    ({}, ["None", "1000", "GOMP_SPINCOUNT=1000"]),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, ["ACTIVE", "None", "OMP_WAIT_POLICY=ACTIVE"]),  # the operator's choice
    ({"OMP_WAIT_POLICY": "PASSIVE"}, ["PASSIVE", "None", "OMP_WAIT_POLICY=PASSIVE"]),
    ({"GOMP_SPINCOUNT": "10000"}, ["None", "10000", "GOMP_SPINCOUNT=10000"]),
])
def test_spin_count_defaults_to_a_short_spin(env, expected):
    assert probe(env) == expected


def test_says_when_torch_loaded_openmp_first():
    """Imported after torch, libgomp already read its settings: the policy says so (benches print it)."""
    late = probe({}, "import torch, inference_service; print(inference_service.openmp_wait_policy())")
    assert late == ["libgomp's default (torch was imported before inference_service)"]
