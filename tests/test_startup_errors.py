"""Start-up errors of the real CLI: one line naming the cause (the file and its problem), exit code 2,
before the server listens, no traceback; Ctrl-C ends a server without one, structured output used."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai SDK is built on
import pytest

from harness.gguf_files import make_base_checkpoint, nested_arrays_gguf, write_gguf
from harness.inference_server import SERVER_DEVICE, start_inference_server

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_base_checkpoint(tmp_path_factory.mktemp("gguf") / "checkpoint")


def _start(args: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "LORAPLEX_DEVICE": SERVER_DEVICE, "OMP_NUM_THREADS": "1",
                "HF_HOME": str(tmp_path / "hf"), **(env or {})}
    full_env.pop("LORAPLEX_MODEL", None)
    return subprocess.run([sys.executable, "-m", "inference_service.cli", "--listen", "127.0.0.1:0",
                           "--http-port", "0", *args], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=300)


def _one_error_line(proc: subprocess.CompletedProcess, *expected: str) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "Traceback" not in output and "LISTENING" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("loraplex-inference: error: "), output[-3000:]
    for text in expected:
        assert text in errors[0], (text, errors[0])


def test_missing_model_file(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.gguf"
    _one_error_line(_start(["--model", str(missing)], tmp_path), str(missing), "no such file")


def test_gguf_with_alignment_zero(tmp_path: Path, checkpoint: Path) -> None:
    path = write_gguf(checkpoint, tmp_path / "align0.gguf", extra_uint32={"general.alignment": 0})
    _one_error_line(_start(["--model", str(path)], tmp_path), str(path), "general.alignment")


def test_gguf_with_deeply_nested_arrays(tmp_path: Path) -> None:
    path = nested_arrays_gguf(tmp_path / "nested.gguf", 200_000)
    _one_error_line(_start(["--model", str(path)], tmp_path), str(path), "nested deeper")


def test_gguf_without_head_counts(tmp_path: Path, checkpoint: Path) -> None:
    path = write_gguf(checkpoint, tmp_path / "noheads.gguf",
                      drop_keys=("llama.attention.head_count", "llama.attention.head_count_kv"))
    _one_error_line(_start(["--model", str(path)], tmp_path), str(path), "llama.attention.head_count is missing")


def test_failed_hugging_face_lookup(tmp_path: Path) -> None:
    proc = _start(["--model", "loraplex-tests/no-such-model"], tmp_path, env={"HF_HUB_OFFLINE": "1"})
    _one_error_line(proc, "loraplex-tests/no-such-model", "not in the Hugging Face cache")


def test_model_is_required(tmp_path: Path) -> None:
    _one_error_line(_start([], tmp_path), "--model")


def test_lora_modules_directory_must_exist(tmp_path: Path) -> None:
    proc = _start(["--model", "builtin:tiny", "--lora-modules", f"a={tmp_path / 'absent'}"], tmp_path)
    _one_error_line(proc, "--lora-modules", "absent", "no such directory")


def test_ctrl_c_after_structured_output_leaves_no_traceback(tmp_path: Path) -> None:
    """SIGINT reaches the whole process group, as a terminal's Ctrl-C does: the server and the grammar
    checker child it started for the structured request."""
    server = start_inference_server(["--shutdown-grace-s", "2"], http=True, log_dir=tmp_path)
    try:
        r = httpx.post(server.http_url + "/v1/completions", timeout=120,
                       json={"model": "builtin:tiny", "prompt": "hi", "max_tokens": 4,
                             "structured_outputs": {"json": {"type": "object"}}})
        assert r.status_code == 200, r.text
        os.killpg(server.proc.pid, signal.SIGINT)
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()
    log = server.log()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]


def test_lora_modules_are_served_from_the_start(tmp_path: Path) -> None:
    """vLLM's `--lora-modules name=path`: the adapter is in before the server reports SERVING, and is a
    model on the HTTP API (its directory allowed without --adapter-source-allow)."""
    from inference_service.demo_adapters import write_peft_adapter
    from inference_service.models.loader import builtin_tiny_config

    adapter = write_peft_adapter(tmp_path / "mine", builtin_tiny_config(), rank=32, seed=3)
    server = start_inference_server(["--lora-modules", f"mine={adapter}"], http=True, log_dir=tmp_path)
    try:
        models = {m["id"] for m in httpx.get(server.http_url + "/v1/models", timeout=30).json()["data"]}
        assert "mine" in models, models
        r = httpx.post(server.http_url + "/v1/completions", timeout=120,
                       json={"model": "mine", "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    finally:
        server.stop()
