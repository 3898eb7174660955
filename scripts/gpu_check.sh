#!/usr/bin/env bash
# The GPU check, one script under 10 minutes on one GPU: the CUDA tests, engine-vs-PEFT on CUDA,
# both benches on CUDA (their RESULT lines), then the whole suite with the device-generic tests
# on CUDA. Each part has its own time limit; a failing part is reported and the rest still run;
# the exit status is non-zero if any part failed or a CUDA test skipped.
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
export LORAPLEX_TEST_DEVICE=cuda  # servers started by tests run on the GPU (tests/infra/devices.py)
"$PY" -c 'import torch, grpc; from inference_service.api import inference_pb2_grpc; import adapter_cache.server
print("torch", torch.__version__, "on", torch.cuda.get_device_name(0), "| grpc", grpc.__version__)'

failed=()
step() {  # NAME LIMIT_S COMMAND...: run one part under a time limit, its output also in $LOG_DIR/NAME.log
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "== $name (limit ${limit} s)"
  if timeout "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log"; then
    echo "== $name: ok in $((SECONDS - start)) s"
  else
    echo "== $name: FAILED after $((SECONDS - start)) s"
    failed+=("$name")
  fi
}
no_skips() {  # NAME: a CUDA part must not skip anything on a GPU
  if grep -q -E "[0-9]+ skipped" "$LOG_DIR/$1.log"; then echo "== $1: tests SKIPPED on a GPU"; failed+=("$1-skips"); fi
}
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider)

step cuda-tests 90 "${PYTEST[@]}" tests/test_gpu.py
no_skips cuda-tests
step peft-on-cuda 120 "${PYTEST[@]}" tests/test_engine_vs_peft.py -k cuda
no_skips peft-on-cuda
step overlap-churn 100 "$PY" bench/overlap_churn.py --device cuda --rounds 3
step engine-throughput 100 "$PY" bench/engine_throughput.py --device cuda --rounds 2
# The whole suite, device-generic tests on CUDA (their "cuda" parameters, and servers via
# LORAPLEX_TEST_DEVICE); modules needing what the image lacks are left out (see the top).
step suite 240 "${PYTEST[@]}" -n 12 --continue-on-collection-errors \
  --ignore=tests/test_cache_s3.py --ignore=tests/test_cache_integration.py \
  --ignore=tests/test_cache_moto_faults.py --ignore=tests/test_helm.py --ignore=tests/test_proto.py \
  --ignore=tests/test_dashboards.py --ignore-glob='tests/test_kubelet*' tests

echo "== RESULT lines"
grep -h "^RESULT" "$LOG_DIR/overlap-churn.log" "$LOG_DIR/engine-throughput.log" || echo "(no RESULT line)"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "== FAILED: ${failed[*]}"
  exit 1
fi
echo "== all parts passed"
