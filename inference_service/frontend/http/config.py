"""HTTP front-end settings (kept apart from serving.py so the CLI parses flags without uvicorn)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HttpConfig:
    port: int = 0  # 0: no HTTP front end
    addr: str = "127.0.0.1"
    served_model_names: tuple[str, ...] = ()  # empty: the checkpoint's name
    chat_template: str | None = None  # a Jinja file overriding the checkpoint's chat template
    tool_call_parser: str = "auto"  # tool_choice auto's parser (frontend/tool_parsers.py PARSERS)
    header_timeout_s: float = 10.0  # a request's headers must arrive within this (slow or idle clients)
    body_timeout_s: float = 30.0  # and its body within this after them
    max_connections: int = 2048  # open connections; more are closed as they are accepted
