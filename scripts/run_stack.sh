#!/usr/bin/env bash
# `make run`: the adapter-cache sidecar plus the inference server on builtin:tiny with demo LoRA
# adapters preloaded, in the foreground until Ctrl-C. No downloads: the adapters are generated
# locally for the tiny model and staged by the sidecar from file:// (its unix socket and shared-
# memory dir live under .run/). Override with LORAPLEX_* env vars, e.g.
# LORAPLEX_LISTEN=127.0.0.1:6000 LORAPLEX_METRICS_PORT=9500 LORAPLEX_CACHE_METRICS_PORT=9501 make run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
RUN_DIR="$(pwd)/.run"
mkdir -p "$RUN_DIR"
preload="$($PY -m inference_service.demo_adapters "$RUN_DIR/adapters" --count 3)"
listen="${LORAPLEX_LISTEN:-127.0.0.1:50051}"
metrics_port="${LORAPLEX_METRICS_PORT:-9400}"
cache_metrics_port="${LORAPLEX_CACHE_METRICS_PORT:-9401}"
cache_socket="$RUN_DIR/adapter-cache.sock"
# The one adapter source both processes accept: without an allow-list every adapter URI is refused.
adapters_uri="file://$RUN_DIR/adapters"
# The sidecar's socket is its user's alone (0600); the token is a second check (docs/sidecar.md).
cache_token="$RUN_DIR/cache-token"
[ -s "$cache_token" ] || (umask 077 && "$PY" -c 'import secrets; print(secrets.token_hex(32))' >"$cache_token")

"$PY" -m adapter_cache.cli \
  --listen "unix://$cache_socket" \
  --shm-dir "$RUN_DIR/shm" \
  --capacity-bytes "${LORAPLEX_CACHE_CAPACITY_BYTES:-1GiB}" \
  --allow-prefix "$adapters_uri" \
  --token-file "$cache_token" \
  --metrics-port "$cache_metrics_port" \
  --metrics-addr 127.0.0.1 &
sidecar=$!
trap 'kill "$sidecar" 2>/dev/null || true; wait "$sidecar" 2>/dev/null || true' EXIT
for _ in $(seq 300); do  # up to 30 s for the sidecar's socket
  [ -S "$cache_socket" ] && break
  kill -0 "$sidecar" 2>/dev/null || { echo "adapter-cache sidecar exited" >&2; exit 1; }
  sleep 0.1
done
[ -S "$cache_socket" ] || { echo "adapter-cache sidecar did not start" >&2; exit 1; }

cat <<MSG
loraplex: serving builtin:tiny on $listen with adapters demo-0 (pinned), demo-1, demo-2,
staged through the adapter-cache sidecar on unix://$cache_socket
  metrics:  curl -s http://127.0.0.1:$metrics_port/metrics | grep loraplex_
            curl -s http://127.0.0.1:$cache_metrics_port/metrics | grep loraplex_cache
  generate: .venv/bin/loraplex --address $listen generate --adapter demo-1 --stream --max-new-tokens 32 "Hello"
  list:     .venv/bin/loraplex --address $listen list
  grpcurl:  .venv/bin/grpcurl -plaintext -d '{"text":"Hello","adapter":"demo-2"}' $listen loraplex.v1.Inference/Generate
Ctrl-C stops both.
MSG

trap 'kill "$server" 2>/dev/null || true' INT TERM
"$PY" -m inference_service.cli \
  --model builtin:tiny \
  --listen "$listen" \
  --metrics-port "$metrics_port" \
  --preload-file "$preload" \
  --adapter-source-allow "$adapters_uri" \
  --cache-address "unix://$cache_socket" \
  --cache-token-file "$cache_token" \
  "$@" &
server=$!
status=0
wait "$server" || status=$?
if kill -0 "$server" 2>/dev/null; then  # a trapped signal ended the first wait: wait for the exit
  status=0
  wait "$server" || status=$?
fi
exit "$status"
