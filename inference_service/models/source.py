"""What `--model` names: builtin:tiny, a Hugging Face checkpoint directory, a GGUF file (or a
directory holding one), or a Hugging Face model id found through the Hugging Face cache."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from adapter_cache.errors import FailedPreconditionError
from inference_service.models import hub
from inference_service.models.gguf import find_gguf

BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["builtin", "hf", "gguf"]
    path: Path | None  # hf: the checkpoint directory; gguf: the .gguf file
    name: str  # the model's name for clients (a repo id as given, else the file or directory name)


def resolve_model(spec: str, revision: str | None = None) -> ModelSource:
    if spec.startswith(BUILTIN_PREFIX):
        _no_revision(spec, revision)
        return ModelSource("builtin", None, spec)
    path = Path(spec).expanduser()
    if path.exists():
        _no_revision(spec, revision)
        return _local(path, path.name)
    if hub.looks_like_repo_id(spec):
        return _local(hub.resolve_repo(spec, revision), spec)
    raise FailedPreconditionError(f"--model {spec}: no such file or directory (expected a Hugging Face checkpoint "
                                  "directory with config.json, a .gguf file, or a Hugging Face model id org/name)")


def _local(path: Path, name: str) -> ModelSource:
    if path.is_file():
        if path.suffix != ".gguf":
            raise FailedPreconditionError(f"{path}: a model file must be .gguf (or pass a checkpoint directory)")
        return ModelSource("gguf", path, path.stem)
    if (path / "config.json").is_file():
        return ModelSource("hf", path, name)
    gguf = find_gguf(path)
    if gguf is not None:
        return ModelSource("gguf", gguf, name if name != path.name else gguf.stem)
    raise FailedPreconditionError(f"{path}: no config.json nor a .gguf file (expected a Hugging Face checkpoint "
                                  "directory or a GGUF file)")


def _no_revision(spec: str, revision: str | None) -> None:
    if revision:
        raise FailedPreconditionError(f"--revision applies to Hugging Face model ids, not to {spec}")
