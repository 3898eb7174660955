#!/usr/bin/env bash
# The GPU check, one script under 10 minutes on one GPU. First what only a GPU can prove (docs/gpu.md):
# the decode step captured in CUDA graphs and replayed (vs eager), the Triton kernels compiled for
# this GPU (vs the torch ops), then the CUDA tests, engine-vs-PEFT on CUDA, the benches on CUDA
# (their RESULT lines: cuda_graph_vs_eager, triton_lora_vs_torch_op, engine_vs_peft, overlap), and
# the whole suite with the device-generic tests on CUDA in whatever time is left. Each part has its
# own time limit; a failing part is reported with what to look at, and the rest still run; the
# exit status is non-zero if any part failed or a CUDA test skipped.
#
# Assumptions (this workplace's GPU machine, /work/.library/device/KINDS.md):
# - `python3` there is the image's environment with a CUDA build of torch matching its driver, plus
#   transformers, peft, pytest, pytest-timeout, pytest-xdist, hypothesis, pyyaml, safetensors,
#   tokenizers, numpy, prometheus-client. That torch is used as it is: a venv made with
#   --system-site-packages sits on top of it (torch is never pip-installed there: nothing can be
#   fetched, and the image's build is the one that fits its driver).
# - The rest of our runtime dependencies travel as wheels in .whl/ (scripts/gpu_wheels.sh makes them
#   where PyPI is reachable; the device tool carries them: carry [".whl"]).
# - A C compiler is there, for the CPU kernels that CPU-side tests build.
# - Debian/npm tools (prometheus, promtool, helm, buf, grpcurl, Ceph) are not: tests needing them
#   skip there (CI is unset) or are left out below (Ceph, moto, helm/kubernetes-validate, grpc_tools,
#   grafana-foundation-sdk); CI runs them on CPU.
# Usage: bash scripts/gpu_check.sh   (logs under $OUT when the device tool sets it, else /tmp/gpu-check)
set -euo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${OUT:-/tmp/gpu-check}
mkdir -p "$LOG_DIR"
BASE_PYTHON=${BASE_PYTHON:-python3}
"$BASE_PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA device here")'

VENV=/tmp/loraplex-gpu-venv
"$BASE_PYTHON" -m venv --system-site-packages "$VENV"
PY="$VENV/bin/python"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export LORAPLEX_TEST_DEVICE=cuda  # servers started by tests run on the GPU (harness/devices.py)
"$PY" -c 'import torch, grpc; from inference_service.api import inference_pb2_grpc; import adapter_cache.server
print("torch", torch.__version__, "on", torch.cuda.get_device_name(0), "| grpc", grpc.__version__)'

# The whole check, setup included, stays under this: each part's limit is cut to what is left, and a
# part with under 20 s left does not start (reported as not run). The suite, last, gets the rest.
TOTAL_S=${TOTAL_S:-570}
failed=()
step() {  # NAME LIMIT_S LOOK_AT COMMAND...: run one part under a time limit, its output also in $LOG_DIR/NAME.log
  local name=$1 limit=$2 look_at=$3 start=$SECONDS left=$((TOTAL_S - SECONDS))
  shift 3
  if [ "$left" -lt 20 ]; then
    echo "== $name: NOT RUN (${left} s left of ${TOTAL_S}); it checks: $look_at"
    failed+=("$name-not-run")
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name (limit ${limit} s)"
  if timeout "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log"; then
    echo "== $name: ok in $((SECONDS - start)) s"
  else
    local status=${PIPESTATUS[0]}
    [ "$status" != 124 ] || status="124, out of time"
    echo "== $name: FAILED (exit $status) after $((SECONDS - start)) s. Look at $LOG_DIR/$name.log: $look_at"
    failed+=("$name")
  fi
}
no_skips() {  # NAME: a CUDA part must not skip anything on a GPU
  if grep -q -E "[0-9]+ skipped" "$LOG_DIR/$1.log"; then echo "== $1: tests SKIPPED on a GPU"; failed+=("$1-skips"); fi
}
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider)

step cuda-graphs 120 "the bucket's decode step captured with torch.cuda.CUDAGraph vs the same step eager \
(engine/decode_graphs.py _cuda_graph: capture errors name the op that synchronised or allocated on the host), and the \
engine's greedy decode through the graphs vs uncaptured (model_runner.py _captured_decode)" \
  "${PYTEST[@]}" tests/test_decode_step.py -k cuda
no_skips cuda-graphs
step triton-kernels 90 "Triton's compile of kernels/triton_lora.py and triton_attention.py for this GPU (a \
CompilationError names the line), then each kernel vs the torch op (tolerance 1e-5 in fp32)" \
  "${PYTEST[@]}" tests/test_triton_kernels.py
no_skips triton-kernels
step cuda-tests 90 "side-stream slot copies, page-locked staged files, the engine on CUDA vs CPU (logits)" \
  "${PYTEST[@]}" tests/test_gpu.py
no_skips cuda-tests
step peft-on-cuda 120 "the engine on CUDA (Triton LoRA op and attention, CUDA graphs for greedy decode) vs \
PEFT's logits" "${PYTEST[@]}" tests/test_engine_vs_peft.py -k cuda
no_skips peft-on-cuda
step gpu-comparisons 120 "its RESULT lines (cuda_graph_vs_eager, triton_lora_vs_torch_op); a 'no RESULT' line \
says which outputs were wrong (captured and eager decode must generate the same tokens)" \
  "$PY" -m bench.engine_throughput --device cuda --requests 32 --adapters 8 --new-tokens 64 --rounds 2 \
  --compare cuda-graph,triton-lora
step engine-throughput 90 "engine vs PEFT tokens/s and PEFT's judgement of the engine's tokens" \
  "$PY" -m bench.engine_throughput --device cuda --rounds 1
step overlap-churn 60 "adapter loads overlapping decode on a side stream" \
  "$PY" -m bench.overlap_churn --device cuda --rounds 2
# The whole suite, device-generic tests on CUDA (their "cuda" parameters, and servers via
# LORAPLEX_TEST_DEVICE); modules needing what the image lacks are left out (see the top).
step suite 240 "the first failures of the suite on CUDA (device-generic tests and servers on the GPU)" \
  "${PYTEST[@]}" -n 12 --continue-on-collection-errors \
  --ignore=tests/test_cache_s3.py --ignore=tests/test_cache_integration.py \
  --ignore=tests/test_cache_moto_faults.py --ignore=tests/test_helm.py --ignore=tests/test_proto.py \
  --ignore=tests/test_dashboards.py --ignore-glob='tests/test_kubelet*' tests

echo "== RESULT lines"
grep -h "^RESULT" "$LOG_DIR/gpu-comparisons.log" "$LOG_DIR/engine-throughput.log" "$LOG_DIR/overlap-churn.log" \
  || echo "(no RESULT line)"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "== FAILED: ${failed[*]}"
  exit 1
fi
echo "== all parts passed"
