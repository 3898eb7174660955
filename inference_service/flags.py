"""Command-line flags declared once, as the fields of a dataclass.

Each field is one flag: its name is the flag's (`max_num_seqs` is `--max-num-seqs`), its annotation
the value's type, and `flag(...)` says the rest: the --help group and text, the default, the
choices, and the config field the value goes to as it is (`into=EngineConfig`, `field=` when the
names differ). From these `build_parser` makes the argparse parser, every flag with its
environment mirror PREFIX_<FLAG> and a help line that shows the default and the variable
(adapter_cache.env_flags); `from_namespace` reads parsed arguments back as the typed dataclass;
`settings_for` gives a config class the values of every flag declared `into` it. A flag whose value
needs work first (a file to read, "on" to a bool) leaves `into` out and the caller builds it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from adapter_cache.env_flags import add_env_flag, env_name

S = TypeVar("S")
_SPEC = "flag"


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    group: str  # the --help section it is listed in
    help: str
    choices: Sequence[str] | None = None
    parse: Callable[[str], Any] | None = None  # the value's parser where the annotation's type is not one
    nargs: str | None = None  # "+": several values after one flag (a list field)
    required: bool = False  # on the command line or through its environment mirror
    into: type | None = None  # the config class whose field takes the value as it is
    field: str | None = None  # that field's name, where it is not the flag's


def flag(group: str, help: str, *, default: Any = dataclasses.MISSING, choices: Sequence[str] | None = None,
         parse: Callable[[str], Any] | None = None, nargs: str | None = None, required: bool = False,
         into: type | None = None, field: str | None = None) -> Any:
    """One flag's declaration, as a dataclass field (a list default is copied for each parse)."""
    spec = FlagSpec(group, help, choices, parse, nargs, required, into, field)
    metadata = {_SPEC: spec}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(field: dataclasses.Field) -> str:
    return "--" + field.name.replace("_", "-")


def _spec(field: dataclasses.Field) -> FlagSpec:
    return field.metadata[_SPEC]


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def _argparse_options(field: dataclasses.Field, annotation: Any, prefix: str) -> dict[str, Any]:
    """argparse's keywords for one field: the action and type follow its annotation."""
    spec = _spec(field)
    options: dict[str, Any] = {}
    if annotation is bool:
        options["action"] = "store_true"
    else:
        options["default"] = _default(field)
        if typing.get_origin(annotation) is list:  # repeatable, or several values after one flag
            options["action"] = "extend" if spec.nargs else "append"
            kinds = list(typing.get_args(annotation))
        elif isinstance(annotation, types.UnionType):  # `int | None`: an int or unset
            kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        else:
            kinds = [annotation]
        value_type = spec.parse or (kinds[0] if len(kinds) == 1 and kinds[0] in (int, float) else None)
        if value_type is not None:
            options["type"] = value_type
    if spec.nargs:
        options["nargs"] = spec.nargs
    if spec.choices is not None:
        options["choices"] = spec.choices
    if spec.required:  # the environment mirror counts as given
        options["required"] = env_name(prefix, flag_name(field)) not in os.environ
    return options


def build_parser(settings: type, parser: argparse.ArgumentParser, prefix: str) -> argparse.ArgumentParser:
    """Adds every field of `settings` to `parser` as a flag, in declaration order, each group where
    its first flag is."""
    groups: dict[str, Any] = {}
    hints = typing.get_type_hints(settings)
    for field in dataclasses.fields(settings):
        spec = _spec(field)
        if spec.group not in groups:
            groups[spec.group] = parser.add_argument_group(spec.group)
        add_env_flag(groups[spec.group], prefix, flag_name(field), spec.help,
                     **_argparse_options(field, hints[field.name], prefix))
    return parser


def from_namespace(settings: type[S], args: argparse.Namespace) -> S:
    """The parsed flags as the settings dataclass."""
    return settings(**{field.name: getattr(args, field.name) for field in dataclasses.fields(settings)})


def settings_for(flags: Any, target: type) -> dict[str, Any]:
    """Keyword arguments for `target`: the value of every flag declared `into=target`."""
    return {spec.field or field.name: getattr(flags, field.name) for field in dataclasses.fields(flags)
            if (spec := _spec(field)).into is target}
