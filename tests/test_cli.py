"""Server and client CLIs: flags, env mirrors, safety checks (no engine started)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

from adapter_cache.errors import PermissionDeniedError
from inference_service import cli, client_cli
from inference_service.flags import flag_name, from_namespace
from inference_service.frontend.auth import AdminAuth, admin_disabled_reason
from inference_service.frontend.preload import PreloadEntry, read_preload_file
from inference_service.kernels import variants
from inference_service.serve_flags import ServeFlags

FLAGS = [
    "--model", "--listen", "--metrics-port", "--max-loras", "--max-lora-rank", "--kv-cache-bytes",
    "--cache-address", "--preload-file", "--max-queue", "--max-new-tokens-limit", "--admin-token-file",
    "--insecure-admin", "--adapter-source-allow", "--tls-cert", "--tls-key", "--tls-client-ca",
    "--max-message-bytes", "--adapter-metrics-top-k", "--max-stop-strings", "--max-stop-string-length",
    "--max-stop-token-ids", "--max-prompt-chars", "--max-request-id-length", "--max-registered-adapters",
    "--host-load-workers", "--adapter-load-timeout-s",
    "--dtype", "--max-model-len", "--preload-reload-s", "--watchdog-stall-s", "--shutdown-grace-s", "--drain-delay-s",
    "--async-scheduling", "--stream-interval", "--max-n",
]


@pytest.fixture(autouse=True)
def _model_named(monkeypatch):
    """--model is required; these tests parse flags about everything else (its env mirror names it)."""
    monkeypatch.setenv("LORAPLEX_MODEL", "builtin:tiny")


@pytest.mark.parametrize("module", ["inference_service.cli", "adapter_cache.cli"])
def test_help_documents_every_flag_and_its_env_var(module):
    """Every flag the parser takes (not a hand-kept list) is in --help with a description and its
    environment mirror; the flags the docs name are among them."""
    import importlib

    mod = importlib.import_module(module)
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                         check=True).stdout
    out = " ".join(out.split())  # argparse wraps long help lines
    actions = [a for a in mod.build_parser()._actions if a.option_strings and a.dest != "help"]
    assert len(actions) > 15
    for action in actions:
        flag = action.option_strings[-1]
        env = mod.ENV_PREFIX + flag.removeprefix("--").replace("-", "_").upper()
        assert flag in out and f"[env {env}]" in out, (flag, env)
        assert action.help.split("[env")[0].split(" (default:")[0].strip(), f"{flag} has no description"
    if module == "inference_service.cli":
        assert set(FLAGS) <= {a.option_strings[-1] for a in actions}


def test_each_flag_is_one_declared_field():
    """The parser holds ServeFlags' fields and nothing else, in their order; a flag declared `into` a
    config names one of that config's fields, and parsed flags read back as the dataclass."""
    fields = dataclasses.fields(ServeFlags)
    parser = cli.build_parser()
    assert [a.option_strings for a in parser._actions if a.dest != "help"] == [[flag_name(f)] for f in fields]
    for field in fields:
        spec = field.metadata["flag"]
        if spec.into is not None:
            assert (spec.field or field.name) in {f.name for f in dataclasses.fields(spec.into)}, field.name
    flags = from_namespace(ServeFlags, parser.parse_args(["--max-num-seqs", "5", "--lora-modules", "a=/x"]))
    assert (flags.model, flags.max_num_seqs, flags.lora_modules) == ("builtin:tiny", 5, [("a", "/x")])


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
    assert [e.name for e in server_cfg.preload] == ["a", "b"] and server_cfg.preload[0].pinned
    assert not server_cfg.preload[1].pinned and server_cfg.preload_file == str(preload)
    assert engine_cfg.dtype == "auto" and server_cfg.shutdown_grace_s == 30.0
    assert (engine_cfg.async_scheduling, engine_cfg.stream_interval) == ("auto", 1)
    engine_cfg, _ = cli.configs_from_args(cli.build_parser().parse_args(
        ["--async-scheduling", "on", "--stream-interval", "8"]))
    assert (engine_cfg.async_scheduling, engine_cfg.stream_interval) == ("on", 8)
    with pytest.raises(ValueError, match="--stream-interval must be >= 1"):
        cli.configs_from_args(cli.build_parser().parse_args(["--stream-interval", "0"]))
    engine_cfg, _ = cli.configs_from_args(cli.build_parser().parse_args(["--lora-memory-bytes", "1000000"]))
    assert (engine_cfg.max_loras, engine_cfg.lora_memory_bytes) == ("auto", 1000000)  # the default pool
    with pytest.raises(ValueError, match="give one or the other"):  # a byte budget a fixed pool would ignore
        cli.configs_from_args(cli.build_parser().parse_args(["--max-loras", "4", "--lora-memory-bytes", "1000000"]))


def test_tenants_adapter_pool_bytes_become_the_engines_pool_shares(tmp_path):
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [
        {"name": "alice", "token_sha256": "ab" * 32, "adapter_pool_bytes": 1 << 20},
        {"name": "bob", "token_sha256": "cd" * 32},
    ]}))
    engine_cfg, _ = cli.configs_from_args(cli.build_parser().parse_args(["--tenants-file", str(tenants)]))
    assert engine_cfg.adapter_pool_shares == {"alice": 1 << 20}  # bob has no share: the pool's common part
    for bad in (-1, "1MiB", 1.5, True):
        tenants.write_text(json.dumps({"tenants": [{"name": "alice", "adapter_pool_bytes": bad}]}))
        with pytest.raises(ValueError, match="adapter_pool_bytes must be a non-negative integer"):
            cli.configs_from_args(cli.build_parser().parse_args(["--tenants-file", str(tenants)]))


def test_prefix_cache_scope_follows_tenant_configuration(tmp_path):
    """Per tenant by default whenever any tenant configuration is given; the operator's flag wins;
    a trusted header that no tenant accepts is a usage error, not a server that refuses everyone."""
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [{"name": "alice", "token_sha256": "ab" * 32}]}))
    opted_in = tmp_path / "opted-in.json"
    opted_in.write_text(json.dumps({"tenants": [{"name": "alice", "via_trusted_header": True}]}))

    def scope(*flags: str) -> str:
        return cli.configs_from_args(cli.build_parser().parse_args(list(flags)))[1].cache_scope

    assert scope() == "shared"
    assert scope("--tenants-file", str(tenants)) == "identity"
    assert scope("--tls-client-ca", str(tmp_path / "ca.pem")) == "identity"
    assert scope("--tenants-file", str(opted_in), "--trusted-tenant-header", "x-tenant") == "identity"
    assert scope("--tenants-file", str(tenants), "--prefix-cache-scope", "shared") == "shared"
    for flags in (["--trusted-tenant-header", "x-tenant"],
                  ["--tenants-file", str(tenants), "--trusted-tenant-header", "x-tenant"]):
        with pytest.raises(ValueError, match="via_trusted_header"):
            scope(*flags)


def test_preload_file_entries_are_checked(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps([{"name": "a", "uri": "file:///a", "required": True}]))
    assert read_preload_file(str(f)) == [PreloadEntry("a", "file:///a", required=True)]
    for bad in ({"nope": 1}, [{"name": "a"}], [{"name": "a", "uri": "u", "pinned": "yes"}],
                [{"name": "a", "uri": "u", "colour": 1}], [{"name": "a", "uri": "u"}, {"name": "a", "uri": "v"}]):
        f.write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            read_preload_file(str(f))


def test_non_loopback_without_admin_token_starts_with_admin_disabled(monkeypatch):
    """The chart's default (no token, 0.0.0.0) starts; admin RPCs are refused with how to enable them."""
    monkeypatch.delenv("LORAPLEX_ADMIN_TOKEN", raising=False)
    _, cfg = cli.configs_from_args(cli.build_parser().parse_args(["--listen", "0.0.0.0:0"]))
    reason = admin_disabled_reason(cfg.listen, cfg.admin_token, cfg.insecure_admin)
    assert reason and "--admin-token-file" in reason and "inference.adminToken.existingSecret" in reason
    with pytest.raises(PermissionDeniedError, match="admin RPCs are disabled"):
        AdminAuth(cfg.admin_token, reason).check([("authorization", "Bearer guess")])
    assert admin_disabled_reason("0.0.0.0:0", None, True) is None  # explicitly allowed
    assert admin_disabled_reason("0.0.0.0:0", "t", False) is None
    assert admin_disabled_reason("127.0.0.1:0", None, False) is None  # loopback: open for local use


def test_client_cli_parses_subcommands(monkeypatch):
    monkeypatch.setenv("LORAPLEX_ADDRESS", "unix:///tmp/x.sock")
    p = client_cli.build_parser()
    a = p.parse_args(["generate", "--adapter", "a", "--stream", "--max-new-tokens", "5", "hi"])
    assert (a.address, a.adapter, a.stream, a.max_new_tokens, a.prompt) == ("unix:///tmp/x.sock", "a", True, 5, "hi")
    a = p.parse_args(["--token", "t", "load", "n", "file:///u", "--pinned", "--preload"])
    assert (a.token, a.name, a.uri, a.pinned, a.preload) == ("t", "n", "file:///u", True, True)
    assert p.parse_args(["unload", "n"]).name == "n"
    assert p.parse_args(["list"]).command == "list"


def _cpu_flags() -> set[str]:
    """This CPU's feature flags as the process's choices read them (capped by LORAPLEX_CPU_VARIANT)."""
    return set(variants.cpu_flags())


def test_dtype_auto(tmp_path, monkeypatch):
    """--dtype auto (the CLI default): the checkpoint's torch_dtype on an accelerator (fp32 when it
    names none), on CPU bf16 where the CPU computes it natively or the AVX2 kernel takes bf16
    projections, else fp32."""
    import torch

    from inference_service.engine.config import EngineConfig
    from inference_service.kernels import avx2_linear
    from inference_service.platform import Platform

    def auto_dtype(model: str, device: torch.device, **settings: str) -> torch.dtype:
        return Platform.dtype(device, EngineConfig(model=model, device=str(device), dtype="auto", **settings))[0]

    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert auto_dtype(str(tmp_path), torch.device("cuda")) == torch.bfloat16
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float16"}))  # transformers 5 spelling
    assert auto_dtype(str(tmp_path), torch.device("cuda")) == torch.float16
    assert auto_dtype("builtin:tiny", torch.device("cuda")) == torch.float32
    # What this CPU offers, from the kernel's own list rather than the code under test: bf16
    # arithmetic in hardware (AVX512-BF16 or AMX), or the AVX2 kernel (AVX2 and FMA without AVX-512,
    # built with a C compiler, kernels not switched off).
    flags = _cpu_flags()
    native_bf16 = bool({"avx512_bf16", "amx_bf16"} & flags)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    kernels_on = os.environ.get("LORAPLEX_CPU_KERNELS", "1").strip().lower() not in {"0", "false", "no", "off"}
    avx2_kernel = {"avx2", "fma"} <= flags and "avx512f" not in flags and compiler is not None and kernels_on
    bf16_here = native_bf16 or avx2_kernel
    assert auto_dtype(str(tmp_path), torch.device("cpu")) == (torch.bfloat16 if bf16_here else torch.float32)
    monkeypatch.setattr(avx2_linear, "preferred", lambda: True)  # an AVX2-only CPU with the kernel built
    assert auto_dtype(str(tmp_path), torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(avx2_linear, "preferred", lambda: False)  # no compiler, kernels switched off, or AVX-512
    assert auto_dtype(str(tmp_path), torch.device("cpu")) == (torch.bfloat16 if native_bf16 else torch.float32)
    monkeypatch.setattr(avx2_linear, "preferred", lambda: True)  # --kernels off: the AVX2 kernel is not used
    assert auto_dtype(str(tmp_path), torch.device("cpu"), kernels="off") == (
        torch.bfloat16 if native_bf16 else torch.float32)
    assert cli.build_parser().parse_args([]).dtype == "auto"


def test_defaults_follow_vllm():
    """HTTP on 8000, max_tokens unset runs to the end of the context (no server default, the limit is
    the context), the adapter rank limit and the memory budget are sized from what the pool holds."""
    args = cli.build_parser().parse_args([])
    engine_cfg, server_cfg = cli.configs_from_args(args)
    assert cli.http_config_from_args(args).port == 8000
    assert server_cfg.default_max_new_tokens is None and engine_cfg.max_new_tokens_limit is None
    assert engine_cfg.max_lora_rank == "auto" and engine_cfg.memory_budget_bytes is None
    zero = cli.build_parser().parse_args(["--default-max-new-tokens", "0"])
    assert cli.configs_from_args(zero)[1].default_max_new_tokens is None


def test_lora_modules_become_start_up_adapters(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    args = cli.build_parser().parse_args(["--lora-modules", f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}"])
    engine_cfg, server_cfg = cli.configs_from_args(args)
    assert [(e.name, e.uri, e.required) for e in server_cfg.lora_modules] == [
        ("a", (tmp_path / "a").as_uri(), True), ("b", (tmp_path / "b").as_uri(), True)]
    assert set(engine_cfg.adapter_source_allow) == {(tmp_path / "a").as_uri(), (tmp_path / "b").as_uri()}
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--lora-modules", "no-equals-sign"])
