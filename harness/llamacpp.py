"""llama.cpp's server as a peer for benches: found where scripts/install_llamacpp.sh built it.

`requantize` writes a copy of a GGUF file in another of llama.cpp's types with its own quantizer, so
both servers read the very same blocks; `start_llama_server` runs llama-server on loopback with
continuous batching over `parallel` slots and waits until /health answers 200 (the model loaded).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from harness.ports import free_port, wait_http_healthy

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BIN = ROOT / ".tools" / "llama.cpp" / "bin"
INSTALL_HINT = "bash scripts/install_llamacpp.sh (about ten minutes on two cores)"


def llamacpp_bin(directory: str | Path | None = None) -> Path | None:
    """The directory holding llama-server and llama-quantize (`directory`, else the default), or None."""
    path = Path(directory) if directory else DEFAULT_BIN
    return path if (path / "llama-server").is_file() and (path / "llama-quantize").is_file() else None


def requantize(bin_dir: Path, source: Path, out: Path, type_name: str, threads: int) -> Path:
    """`source` rewritten as `type_name` (e.g. Q4_0) by llama-quantize; kept if already there."""
    if not out.exists():
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(out), type_name,
                        str(threads)], check=True, capture_output=True, text=True, timeout=600)
    return out


@dataclass
class LlamaServer:
    process: subprocess.Popen
    url: str

    def stop(self, timeout: float = 30) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_llama_server(bin_dir: Path, model: Path, parallel: int, context_per_slot: int, threads: int,
                       log: Path) -> LlamaServer:
    """llama-server on `model` with `parallel` slots of `context_per_slot` tokens each, on `threads` threads."""
    port = free_port()
    argv = [str(bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(parallel), "-c", str(parallel * context_per_slot), "-t", str(threads), "-tb", str(threads),
            "--cont-batching", "--no-webui"]
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ})
    server = LlamaServer(process, f"http://127.0.0.1:{port}")
    try:
        wait_http_healthy(server.url, process, timeout=120)
    except BaseException:
        server.stop()
        raise
    return server
