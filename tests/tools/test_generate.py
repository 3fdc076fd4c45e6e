"""`specrun generate` picks its draft head: the shipped one for the embedded model, the one
asked for, or none."""

from __future__ import annotations

import argparse

import pytest

from specrun.models.default import default_head_dir
from specrun.tools.generate import draft_dir


def _args(**overrides) -> argparse.Namespace:
    return argparse.Namespace(**({"model": None, "draft": None, "no_draft": False} | overrides))


def test_embedded_model_speculates_with_the_shipped_head_by_default():
    assert draft_dir(_args()) == default_head_dir()


def test_other_models_and_no_draft_decode_plainly_unless_a_head_is_given():
    assert draft_dir(_args(model="some/llama")) is None
    assert draft_dir(_args(no_draft=True)) is None
    assert draft_dir(_args(model="some/llama", draft="head")) == "head"


def test_draft_and_no_draft_together_are_refused():
    with pytest.raises(ValueError, match="--no-draft"):
        draft_dir(_args(draft="head", no_draft=True))
