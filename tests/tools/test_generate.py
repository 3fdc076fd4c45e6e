"""`specrun generate` and `specrun compile` pick their draft head as `Engine.from_pretrained`
does: the shipped one for the embedded model, the one asked for, or none."""

from __future__ import annotations

import argparse

import pytest

from specrun.models.default import default_head_dir, resolve_draft
from specrun.runtime import aot
from specrun.runtime.config import EngineConfig
from specrun.tools.cli import build_parser
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


def test_resolve_draft_spells_out_the_defaults_and_refuses_other_values():
    assert resolve_draft(None, None) == default_head_dir()
    assert resolve_draft("some/llama", None) is None
    assert resolve_draft(None, False) is None
    assert resolve_draft("some/llama", "head") == "head"
    for bad in (True, 1, ["head"]):
        with pytest.raises(TypeError, match="draft must be"):
            resolve_draft(None, bad)


def test_the_compile_command_of_a_plain_embedded_engine_says_no_draft():
    config = EngineConfig(buckets=(1,))
    command = aot.compile_command(model_dir=None, draft=None, config=config, out="o")
    assert "--no-draft" in command
    args = build_parser().parse_args(command.split()[1:])
    assert draft_dir(args) is None
