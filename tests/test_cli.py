"""Server and client CLIs: flags, env mirrors, safety checks (no engine started)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from inference_service import cli, client_cli

FLAGS = [
    "--model", "--listen", "--metrics-port", "--max-loras", "--max-lora-rank", "--kv-cache-bytes",
    "--cache-address", "--preload-file", "--max-queue", "--max-new-tokens-limit", "--admin-token-file",
    "--insecure-admin", "--adapter-source-allow", "--tls-cert", "--tls-key", "--tls-client-ca",
    "--max-message-bytes", "--adapter-metrics-top-k",
]


def test_help_documents_every_flag_and_its_env_var():
    out = subprocess.run([sys.executable, "-m", "inference_service.cli", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for flag in FLAGS:
        assert flag in out, flag
        assert cli._env_name(flag) in out, cli._env_name(flag)


def test_env_vars_mirror_flags(monkeypatch):
    monkeypatch.setenv("LORAPLEX_MAX_LORAS", "7")
    monkeypatch.setenv("LORAPLEX_INSECURE_ADMIN", "true")
    monkeypatch.setenv("LORAPLEX_ADAPTER_SOURCE_ALLOW", "file:///a,s3://b/c/")
    args = cli.build_parser().parse_args([])
    assert args.max_loras == 7 and args.insecure_admin
    assert args.adapter_source_allow == ["file:///a", "s3://b/c/"]
    args = cli.build_parser().parse_args(["--max-loras", "3"])  # flags win
    assert args.max_loras == 3


def test_configs_from_args(tmp_path, monkeypatch):
    monkeypatch.delenv("LORAPLEX_ADMIN_TOKEN", raising=False)
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    preload = tmp_path / "preload.yaml"
    preload.write_text("- {name: a, uri: 'file:///x/a', pinned: true}\n- {name: b, uri: 'file:///x/b'}\n")
    args = cli.build_parser().parse_args([
        "--max-loras", "4", "--max-lora-rank", "32", "--kv-cache-bytes", "1000000", "--max-queue", "9",
        "--max-new-tokens-limit", "100", "--admin-token-file", str(token), "--listen", "0.0.0.0:1",
        "--preload-file", str(preload), "--adapter-source-allow", "file:///x", "--host-cache-bytes", "0",
    ])
    engine_cfg, server_cfg = cli.configs_from_args(args)
    assert (engine_cfg.max_loras, engine_cfg.max_lora_rank, engine_cfg.kv_cache_bytes) == (4, 32, 1000000)
    assert (engine_cfg.max_queue, engine_cfg.max_new_tokens_limit) == (9, 100)
    assert server_cfg.adapter_source_allow == ("file:///x",) and engine_cfg.host_cache_bytes == 0
    assert server_cfg.admin_token == "s3cret"
    assert [e["name"] for e in server_cfg.preload] == ["a", "b"] and server_cfg.preload[0]["pinned"]


def test_json_preload_file(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps([{"name": "a", "uri": "file:///a"}]))
    assert cli.load_preload_file(str(f)) == [{"name": "a", "uri": "file:///a"}]
    f.write_text(json.dumps({"nope": 1}))
    with pytest.raises(ValueError):
        cli.load_preload_file(str(f))


def test_refuses_non_loopback_without_admin_token(monkeypatch):
    monkeypatch.delenv("LORAPLEX_ADMIN_TOKEN", raising=False)
    r = subprocess.run([sys.executable, "-m", "inference_service.cli", "--listen", "0.0.0.0:0"],
                       capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in __import__("os").environ.items() if k != "LORAPLEX_ADMIN_TOKEN"})
    assert r.returncode == 2 and "refusing to listen on non-loopback" in r.stderr, r.stderr
    args = cli.build_parser().parse_args(["--listen", "0.0.0.0:0", "--insecure-admin"])
    cli.configs_from_args(args)  # explicitly allowed
    monkeypatch.setenv("LORAPLEX_ADMIN_TOKEN", "t")
    cli.configs_from_args(cli.build_parser().parse_args(["--listen", "0.0.0.0:0"]))


def test_client_cli_parses_subcommands(monkeypatch):
    monkeypatch.setenv("LORAPLEX_ADDRESS", "unix:///tmp/x.sock")
    p = client_cli.build_parser()
    a = p.parse_args(["generate", "--adapter", "a", "--stream", "--max-new-tokens", "5", "hi"])
    assert (a.address, a.adapter, a.stream, a.max_new_tokens, a.prompt) == ("unix:///tmp/x.sock", "a", True, 5, "hi")
    a = p.parse_args(["--token", "t", "load", "n", "file:///u", "--pinned", "--preload"])
    assert (a.token, a.name, a.uri, a.pinned, a.preload) == ("t", "n", "file:///u", True, True)
    assert p.parse_args(["unload", "n"]).name == "n"
    assert p.parse_args(["list"]).command == "list"
