"""Built-in prompt splits: deterministic, sized, and disjoint in subjects and templates."""

from __future__ import annotations

import pytest

from specrun.runtime.distill import prompts as p
from specrun.runtime.distill.data import read_prompts


def test_splits_are_disjoint_and_deterministic():
    assert not set(p._TRAIN_SUBJECTS) & set(p._HELDOUT_SUBJECTS)
    assert not set(p._TRAIN_TEMPLATES) & set(p._HELDOUT_TEMPLATES)
    train, heldout = read_prompts("builtin:train"), read_prompts("builtin:heldout")
    assert len(train) >= 2000 and len(heldout) >= 90
    assert not set(train) & set(heldout)
    assert p.builtin_prompts("train", seed=0) == train
    assert p.builtin_prompts("train", num_prompts=5, seed=1) != train[:5]


def test_unknown_split_is_refused():
    with pytest.raises(ValueError, match="split"):
        read_prompts("builtin:test")
