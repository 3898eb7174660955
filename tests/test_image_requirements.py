"""scripts/image_requirements.py: which of pip's resolved packages the image keeps (fast, no image).

A left-out package goes, with what only it pulls in; what another kept package also needs stays; an
extra's requirement counts only when that extra was asked for."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("image_requirements", REPO / "scripts" / "image_requirements.py")
image_requirements = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(image_requirements)


def _item(name: str, requires: list[str], requested: bool = False, extras: list[str] | None = None) -> dict:
    item = {"metadata": {"name": name, "version": "1.0", "requires_dist": requires}, "requested": requested}
    if extras is not None:
        item["requested_extras"] = extras
    return item


def test_left_out_packages_go_with_what_only_they_need(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = []\n[tool.loraplex.image]\nleave-out = ["triton", "Typer"]\n')
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"install": [
        _item("xgrammar", ["triton; platform_system == 'Linux'", "transformers"], requested=True),
        _item("transformers", ["typer", "tokenizers"]),
        _item("typer", ["rich", "click"]),
        _item("rich", ["pygments"]),
        _item("pygments", []),
        _item("triton", []),
        _item("tokenizers", []),
        _item("huggingface_hub", ["click"], requested=True),
        _item("click", []),
        _item("uvicorn", ["httptools; extra == 'standard'", "h11"], requested=True, extras=[]),
        _item("httptools", []),
        _item("h11", []),
        _item("fastapi", ["email-validator; extra == 'all'"], requested=True, extras=["all"]),
        _item("email-validator", []),
    ]}))
    lines = image_requirements.pins(str(pyproject), str(report))
    kept = [line for line in lines if not line.startswith("#")]
    assert kept == ["click==1.0", "email-validator==1.0", "fastapi==1.0", "h11==1.0", "huggingface_hub==1.0",
                    "tokenizers==1.0", "transformers==1.0", "uvicorn==1.0", "xgrammar==1.0"]
    assert [line for line in lines if line.startswith("#")] == [
        "# left-out httptools", "# left-out pygments", "# left-out rich", "# left-out triton", "# left-out typer"]

