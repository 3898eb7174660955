"""The API protos: generated code is fresh, buf lint is clean, no breaking change vs the baseline.

The baseline is the image of the first released loraplex.v1 (both protos), built in protos/ with
`.tools/bin/buf build -o baseline/loraplex-v1.binpb`; rebuild it only when cutting a new major version.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROTOS = ROOT / "protos"
API = ROOT / "inference_service" / "api"
BASELINE = PROTOS / "baseline" / "loraplex-v1.binpb"
BUF = ROOT / ".tools" / "bin" / "buf"

needs_buf = pytest.mark.needs_tool("buf", BUF)


def _proto_stems() -> list[str]:
    return sorted(p.stem for p in (PROTOS / "loraplex" / "v1").glob("*.proto"))


def test_every_proto_has_committed_generated_code():
    stems = _proto_stems()
    assert "inference" in stems and "adapter_cache" in stems
    for stem in stems:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert (API / f"{stem}{suffix}").is_file(), f"missing generated {stem}{suffix}: run `make proto`"


def test_generated_code_is_fresh(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, cwd=ROOT)
    fresh_dir = tmp_path / "inference_service" / "api"
    fresh = sorted(p.name for p in fresh_dir.iterdir() if "_pb2" in p.name)
    assert fresh, "gen_proto.sh generated nothing"
    committed = sorted(p.name for p in API.iterdir() if "_pb2" in p.name)
    assert fresh == committed, "generated file set differs from the committed one: run `make proto`"
    for name in fresh:
        assert (fresh_dir / name).read_bytes() == (API / name).read_bytes(), f"{name} is stale: run `make proto`"


def test_generated_modules_import():
    from inference_service.api import inference_pb2, inference_pb2_grpc

    assert inference_pb2.DESCRIPTOR.package == "loraplex.v1"
    assert "Inference" in inference_pb2.DESCRIPTOR.services_by_name
    assert hasattr(inference_pb2_grpc, "InferenceStub")


def _buf(*args: str, cwd: Path = PROTOS) -> subprocess.CompletedProcess:
    return subprocess.run([str(BUF), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_buf
def test_buf_lint_clean():
    r = _buf("lint")
    assert r.returncode == 0, f"buf lint:\n{r.stdout}{r.stderr}"


@needs_buf
def test_no_breaking_change_against_baseline():
    assert BASELINE.is_file(), f"missing baseline image {BASELINE}"
    r = _buf("breaking", "--against", str(BASELINE))
    assert r.returncode == 0, f"buf breaking vs {BASELINE.name}:\n{r.stdout}{r.stderr}"


@needs_buf
def test_breaking_check_catches_a_removed_field(tmp_path):
    """The baseline check is live: deleting a field from a copy of the protos must fail it."""
    work = tmp_path / "protos"
    shutil.copytree(PROTOS, work, ignore=shutil.ignore_patterns("baseline"))
    proto = work / "loraplex" / "v1" / "inference.proto"
    text = proto.read_text()
    assert "  bool ignore_eos = 9;\n" in text
    proto.write_text(text.replace("  bool ignore_eos = 9;\n", ""))
    r = _buf("breaking", "--against", str(BASELINE), cwd=work)
    assert r.returncode != 0 and "ignore_eos" in (r.stdout + r.stderr), r.stdout + r.stderr
