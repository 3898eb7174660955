"""argparse flags with environment-variable mirrors, shared by both services' CLIs.

`--max-loras` ↔ `<PREFIX>MAX_LORAS`; repeatable flags take a comma-separated list, switches
take 1/true/yes/on. A flag on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

_TRUE = {"1", "true", "yes", "on"}


def env_name(prefix: str, flag: str) -> str:
    return prefix + flag.lstrip("-").replace("-", "_").upper()


def add_env_flag(parser: argparse.ArgumentParser | Any, prefix: str, flag: str, help: str, **kw: Any) -> None:
    """Adds `flag` (to a parser or an argument group) with its default read from the environment."""
    env = env_name(prefix, flag)
    raw = os.environ.get(env)
    action = kw.get("action")
    if raw is not None:
        if action == "store_true":
            kw["default"] = raw.strip().lower() in _TRUE
        elif action in ("append", "extend"):
            conv = kw.get("type", str)
            try:
                kw["default"] = [conv(v.strip()) for v in raw.split(",") if v.strip()]
            except (ValueError, argparse.ArgumentTypeError):
                raise SystemExit(f"{env}={raw!r} is not valid for {flag}") from None
        else:
            conv = kw.get("type", str)
            try:
                kw["default"] = conv(raw)
            except (ValueError, argparse.ArgumentTypeError):
                raise SystemExit(f"{env}={raw!r} is not valid for {flag}") from None
    default = kw.get("default")
    shown = "" if default in (None, False, [], ()) or action in ("append", "extend") else f" (default: {default})"
    parser.add_argument(flag, help=f"{help}{shown} [env {env}]", **kw)
