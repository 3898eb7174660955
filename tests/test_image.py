"""The CPU image itself (scripts/build_image.sh, which fails when the image is over its size limit): what
its runtime stage holds, run as the chart runs it (uid 10001, read-only root filesystem, no network).

- no C compiler and no pip: the CPU kernels are built in the build stage, and (an image built with
  CPU_KERNELS=1, the default, as its label says) every one of them loads from the prebuilt variants;
- none of the packages pyproject.toml's `[tool.loraplex.image] leave-out` names, and no CUDA runtime
  wheel (`nvidia-*`), while what the services import is there: scripts/image_smoke_check.py imports the
  servers and runs the structured-output path (xgrammar compiles a JSON schema, its matcher masks logits);
- the image's own command (`--help`) and both entry points start.

The pods that run the image under the chart are tests/test_kubelet_pod.py's `[image]` cases.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from harness.pod import image_under_test, podman

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the first build of a session takes minutes

# The runtime stage as the chart's securityContext runs it.
RUN = ["run", "--rm", "--pull", "never", "--network", "none", "--read-only", "--user", "10001:10001"]
CONTENTS = ("import importlib.metadata as md, json, shutil;"
            "print(json.dumps({'tools': [t for t in ('cc', 'gcc', 'pip', 'pip3') if shutil.which(t)],"
            " 'dists': sorted(d.metadata['Name'].lower().replace('_', '-') for d in md.distributions())}))")


@pytest.fixture(scope="module")
def image() -> str:
    """Built by scripts/build_image.sh (cached layers: seconds when nothing changed); LORAPLEX_TEST_IMAGE=TAG:
    that image, already built, instead."""
    return image_under_test("the image tests")


def test_runtime_stage_has_no_compiler_pip_or_left_out_packages(image: str) -> None:
    contents = json.loads(podman(*RUN, image, "python", "-c", CONTENTS, timeout=120).stdout)
    assert contents["tools"] == []
    left_out = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["loraplex"]["image"]["leave-out"]
    dists = set(contents["dists"])
    assert {"xgrammar", "torch", "transformers", "loraplex"} <= dists
    assert dists.isdisjoint(left_out), dists & set(left_out)
    assert not [d for d in dists if d.startswith("nvidia-")]


def _label(image: str, name: str) -> str:
    return podman("image", "inspect", "--format", f'{{{{index .Config.Labels "{name}"}}}}', image).stdout.strip()


def test_prebuilt_kernels_load_without_a_compiler(image: str) -> None:
    if _label(image, "io.loraplex.cpu-kernels") != "1":
        pytest.skip("the image was built with CPU_KERNELS=0: no prebuilt kernels")
    assert _label(image, "io.loraplex.runtime-compiler") == "0"
    # torch first, as in the service: its wheel's libgomp.so.1 is the OpenMP runtime the kernels link to.
    script = ("import json, torch; from inference_service.kernels import build as b;"
              "names = sorted({n for libs in b.read_manifest(b.prebuilt_dir()).values() for n in libs});"
              "print(json.dumps({'names': names, 'missing': [n for n in names if b.load_library(n) is None]}))")
    result = json.loads(podman(*RUN, image, "python", "-c", script, timeout=300).stdout.splitlines()[-1])
    assert result["names"] and result["missing"] == [], result


def test_structured_output_path_runs_in_the_image(image: str) -> None:
    check = REPO / "scripts" / "image_smoke_check.py"
    out = podman(*RUN, "-v", f"{check}:/check/image_smoke_check.py:ro", image,
                 "python", "-P", "/check/image_smoke_check.py", timeout=300).stdout
    assert "compiles and masks" in out, out


@pytest.mark.parametrize("command", [[], ["loraplex-inference", "--help"], ["loraplex-cache", "--help"]])
def test_entry_points_start(image: str, command: list[str]) -> None:
    out = podman(*RUN, image, *command, timeout=300).stdout
    assert out.startswith("usage: loraplex-"), out[:500]
