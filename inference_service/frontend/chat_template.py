"""Chat templates: a checkpoint's Jinja `chat_template`, rendered as Hugging Face renders it.

Same environment as transformers' `apply_chat_template` (an immutable sandbox with
trim_blocks/lstrip_blocks and loop controls, `raise_exception`, a `tojson` that does not escape
HTML, `strftime_now`), the special tokens as template variables, and `add_generation_prompt`.
Templates come from the checkpoint (tokenizer_config.json's `chat_template`, or
chat_template.jinja beside it, or a GGUF file's `tokenizer.chat_template`) or from
`--chat-template FILE`; they are untrusted code, hence
the sandbox.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from adapter_cache.errors import InvalidArgumentError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
MAX_RENDERED_CHARS = 4 << 20  # a template loop cannot make the server build an unbounded prompt


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled template plus the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not compile: {e}") from None
        self.special_tokens = dict(special_tokens or {})
        self.source = source  # its text: which tool-call syntax it teaches (frontend/tool_parsers.py)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, **kwargs: Any) -> str:
        """The prompt text; a template's raise_exception or a template error is INVALID_ARGUMENT."""
        if continue_final_message and add_generation_prompt:
            raise InvalidArgumentError("continue_final_message and add_generation_prompt cannot both be set")
        tag = "\x00CONTINUE_FINAL_MESSAGE\x00"
        if continue_final_message:
            last = messages[-1]
            if not isinstance(last.get("content"), str):
                raise InvalidArgumentError("continue_final_message needs a final message with text content")
            messages = [*messages[:-1], {**last, "content": last["content"] + tag}]
        try:
            text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens, **kwargs})
        except jinja2.exceptions.TemplateError as e:
            raise InvalidArgumentError(f"chat template: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise InvalidArgumentError(f"chat template failed on these messages: {e}") from None
        if len(text) > MAX_RENDERED_CHARS:
            raise InvalidArgumentError(f"rendered chat prompt is over {MAX_RENDERED_CHARS} characters")
        if continue_final_message:
            if tag not in text:
                raise InvalidArgumentError("the chat template dropped the final message to continue")
            text = text[: text.rindex(tag)]
        return text


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def load_chat_template(checkpoint: str | None, override: str | None = None,
                       revision: str | None = None) -> ChatTemplate | None:
    """The template to serve: `override` (a file) if given, else the checkpoint's (a directory's
    tokenizer_config.json or chat_template.jinja, a GGUF file's tokenizer.chat_template), else None.
    A Hugging Face model id is found as --model finds it (models/source.py), `revision` pinning it."""
    root = _checkpoint_path(checkpoint, revision)
    if root is not None and root.suffix == ".gguf" and root.is_file():
        from inference_service.models.gguf import GGUFFile

        gguf = GGUFFile(root)
        source = Path(override).read_text(encoding="utf-8") if override else gguf.chat_template()
        return ChatTemplate(source, gguf.special_tokens()) if source is not None else None
    config: dict[str, Any] = {}
    if root is not None and (root / "tokenizer_config.json").is_file():
        config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
    special = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
    if override:
        return ChatTemplate(Path(override).read_text(encoding="utf-8"), special)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str) and root is not None and (root / "chat_template.jinja").is_file():
        source = (root / "chat_template.jinja").read_text(encoding="utf-8")
    return ChatTemplate(source, special) if isinstance(source, str) else None


def _checkpoint_path(checkpoint: str | None, revision: str | None) -> Path | None:
    """A checkpoint directory or GGUF file (None: builtin); a directory that holds one GGUF file
    and no config.json stands for that file, as in --model."""
    if not checkpoint or checkpoint.startswith("builtin:"):
        return None
    path = Path(checkpoint).expanduser()
    if not path.exists():
        from inference_service.models.source import resolve_model

        path = resolve_model(checkpoint, revision).path or path
    if path.is_dir() and not (path / "config.json").is_file():
        from inference_service.models.gguf import find_gguf

        path = find_gguf(path) or path
    return path
