#!/usr/bin/env bash
# `make run`: the inference server on builtin:tiny with demo LoRA adapters preloaded, in the
# foreground until Ctrl-C. No downloads: the adapters are generated locally for the tiny model.
# Adapters are read straight from file:// (no sidecar). Override with LORAPLEX_* env vars,
# e.g. LORAPLEX_LISTEN=127.0.0.1:6000 LORAPLEX_METRICS_PORT=9500 make run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
RUN_DIR=.run
mkdir -p "$RUN_DIR"
preload="$($PY -m inference_service.demo_adapters "$RUN_DIR/adapters" --count 3)"
listen="${LORAPLEX_LISTEN:-127.0.0.1:50051}"
metrics_port="${LORAPLEX_METRICS_PORT:-9400}"
adapters_uri="file://$(cd "$RUN_DIR/adapters" && pwd)"

cat <<MSG
loraplex: serving builtin:tiny on $listen with adapters demo-0 (pinned), demo-1, demo-2
  metrics:  curl -s http://127.0.0.1:$metrics_port/metrics | grep loraplex_
  generate: .venv/bin/loraplex --address $listen generate --adapter demo-1 --stream --max-new-tokens 32 "Hello"
  list:     .venv/bin/loraplex --address $listen list
  grpcurl:  .venv/bin/grpcurl -plaintext -d '{"text":"Hello","adapter":"demo-2"}' $listen loraplex.v1.Inference/Generate
Ctrl-C stops it.
MSG

exec "$PY" -m inference_service.cli \
  --model builtin:tiny \
  --listen "$listen" \
  --metrics-port "$metrics_port" \
  --preload-file "$preload" \
  --adapter-source-allow "$adapters_uri" \
  "$@"
