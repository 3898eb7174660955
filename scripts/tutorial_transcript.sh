#!/usr/bin/env bash
# Prints docs/tutorial.md's transcript from a real run, so that every output and number it shows can
# be made again: starts `make run`'s stack (scripts/run_stack.sh: SmolLM2-135M-Instruct with the demo
# adapters), runs each command the tutorial shows, in its order, printing `$ command` and what it
# printed, then the stack's own log up to its banner, and stops the stack.
# `bash scripts/tutorial_transcript.sh > transcript.txt`; the ports are run_stack.sh's (LORAPLEX_*).
set -euo pipefail
cd "$(dirname "$0")/.."
export LORAPLEX_RUN_DIR="${LORAPLEX_RUN_DIR:-$(pwd)/.run}"
http="http://127.0.0.1:${LORAPLEX_HTTP_PORT:-8000}"
export LORAPLEX_ADDRESS="${LORAPLEX_LISTEN:-127.0.0.1:50051}"
cache_metrics="http://127.0.0.1:${LORAPLEX_CACHE_METRICS_PORT:-9401}/metrics"
log="$(mktemp)"
scratch="$(mktemp -d)"
setsid bash scripts/run_stack.sh >"$log" 2>&1 &
stack=$!
trap 'kill -INT -- "-$stack" 2>/dev/null || true; wait "$stack" 2>/dev/null || true; rm -rf "$log" "$scratch"' EXIT
for _ in $(seq 1200); do  # up to 10 min: a first run downloads the model
  grep -q '^Ctrl-C stops both' "$log" && break
  kill -0 "$stack" 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.5
done

run() {  # prints the command as the tutorial shows it, then its output
  printf '$ %s\n' "$1"
  bash -c "$1" 2>&1 || true
  echo
}
chat() {  # $1 model, $2 question: the tutorial's curl, answer only
  local body="{\"model\": \"$1\", \"max_tokens\": 64, \"messages\": [{\"role\": \"user\", \"content\": \"$2\"}], \"temperature\": 0}"
  run "curl -s $http/v1/chat/completions -H 'Content-Type: application/json' -d '$body' | python3 -c 'import json, sys; print(json.load(sys.stdin)[\"choices\"][0][\"message\"][\"content\"])'"
}

echo "## 2. Ask over HTTP"
run "curl -s $http/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\": \"SmolLM2-135M-Instruct\", \"max_tokens\": 64, \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"temperature\": 0}'"
chat bullets "What is the capital of France?"
chat json "What is the capital of France?"

echo "## 3. The openai SDK"
cat >"$scratch/sdk.py" <<PY
from openai import OpenAI

client = OpenAI(base_url="$http/v1", api_key="unused")
for model in ["SmolLM2-135M-Instruct", "bullets", "json"]:
    reply = client.chat.completions.create(
        model=model, temperature=0, max_tokens=64,
        messages=[{"role": "user", "content": "Why do cats purr?"}])
    print(f"{model}: {reply.choices[0].message.content}")

stream = client.chat.completions.create(
    model="bullets", temperature=0, max_tokens=64, stream=True,
    messages=[{"role": "user", "content": "What is a rainbow?"}])
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="|", flush=True)
print()
PY
run ".venv/bin/python $scratch/sdk.py"
run "curl -sN $http/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\": \"json\", \"stream\": true, \"temperature\": 0, \"max_tokens\": 64, \"messages\": [{\"role\": \"user\", \"content\": \"Who was Marie Curie?\"}]}'"

echo "## 4. gRPC"
P='<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n'
run ".venv/bin/loraplex generate --max-new-tokens 64 \"\$(printf '$P')\""
run ".venv/bin/loraplex generate --adapter bullets --stream --max-new-tokens 64 \"\$(printf '$P')\""
run ".venv/bin/loraplex generate --adapter json --max-new-tokens 64 \"\$(printf '$P')\""
run ".venv/bin/loraplex list; .venv/bin/loraplex info"

echo "## 5. Load a third adapter"
run "curl -s $http/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\": \"brief\", \"max_tokens\": 64, \"messages\": [{\"role\": \"user\", \"content\": \"Tell me about the Moon.\"}]}'"
run "curl -s $http/v1/load_lora_adapter -H 'Content-Type: application/json' -d '{\"lora_name\": \"brief\", \"lora_path\": \"$PWD/demo/adapters/brief\"}'"
chat SmolLM2-135M-Instruct "Tell me about the Moon."
chat brief "Tell me about the Moon."
run "curl -s $http/v1/models | python3 -c 'import json, sys; print([m[\"id\"] for m in json.load(sys.stdin)[\"data\"]])'"

echo "## 6. What /metrics shows"
run "curl -s $http/metrics | grep -E '^(vllm:lora_requests_info|vllm:num_requests|loraplex_lora_slots|loraplex_lora_loads_total|loraplex_requests_finished_total|loraplex_generation_tokens_total)'"
run "curl -s $cache_metrics | grep -E '^loraplex_cache_(entries|bytes|hits|misses)'"

echo "## 1. make run (its log up to the banner)"
sed -n '1,/^Ctrl-C stops both/p' "$log"
