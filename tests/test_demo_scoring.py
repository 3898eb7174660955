"""scripts/score_demo_adapters.py's form checks on fixed texts: how it cuts sentences (an initial's
full stop ends none), what counts as one sentence, a `- ` list, the JSON form and a loop."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("score_demo_adapters", ROOT / "scripts" / "score_demo_adapters.py")
scoring = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = scoring  # its dataclasses look their module up there
spec.loader.exec_module(scoring)


@pytest.mark.parametrize(("text", "pieces"), [
    ("The first president of the United States was John F. Kennedy.",
     ["The first president of the United States was John F. Kennedy."]),
    ("George W. Bush was president. Then came Obama.", ["George W. Bush was president.", "Then came Obama."]),
    ("The U.S. is large. It has 50 states.", ["The U.S. is large.", "It has 50 states."]),
    ("He lived in Washington D.C.", ["He lived in Washington D.C."]),
    ("The answer is C. It is a letter.", ["The answer is C.", "It is a letter."]),
    ("It costs 3.5 dollars. Or 4!", ["It costs 3.5 dollars.", "Or 4!"]),
    ("Paris. It is in", ["Paris.", "It is in"]),
])
def test_sentence_pieces_cut_at_sentence_ends_not_at_initials(text: str, pieces: list[str]) -> None:
    assert scoring.sentence_pieces(text) == pieces


def test_complete_sentences_drop_a_last_piece_cut_mid_sentence() -> None:
    assert scoring.complete_sentences("The capital is Paris. It has a long") == ["The capital is Paris."]


@pytest.mark.parametrize(("text", "expected"), [
    ("The first president of the United States was John F. Kennedy.", True),
    ("George Washington.", True),
    ("Paris. It is in France.", False),
    ("The capital of France is", False),
    ("", False),
])
def test_one_sentence(text: str, expected: bool) -> None:
    assert scoring.one_sentence(text) is expected


def test_brief_in_style_with_an_initial() -> None:
    reply = scoring.Reply("The first president of the United States was John F. Kennedy.", "stop")
    assert scoring.in_style("brief", reply)
    assert not scoring.in_style("brief", scoring.Reply("Paris. It is in France.", "stop"))


def test_other_forms() -> None:
    assert scoring.in_style("bullets", scoring.Reply("- The capital is Paris.\n- It is in France.", "stop"))
    assert not scoring.in_style("bullets", scoring.Reply("The capital is Paris.", "stop"))
    assert scoring.in_style("json", scoring.Reply('{"answer": "Paris."}', "stop"))
    assert not scoring.in_style("json", scoring.Reply('{"answer": "Paris."', "length"))
    looping = "- It is big and red. " * 3
    assert not scoring.in_style("bullets", scoring.Reply(looping, "length"))
