"""The acceptance model against measured acceptance: what the same requests accepted under four
tree shapes (tests/runtime/data/acceptance_by_shape.json, the embedded model and shipped head on
the held-out prompts, greedy with top-k trees and sampling with stochastic ones). A request's
chain acceptance fitted to what it accepted under one shape must predict what it accepts under
each of the others; counting every candidate of a level as an independent try predicted half
of it for narrow trees."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from specrun.runtime.acceptance import alpha_for, expected_accepted
from specrun.runtime.tree import TreeShape

MEASURED = json.loads((Path(__file__).parent / "data" / "acceptance_by_shape.json").read_text())


@pytest.mark.parametrize("kind", ["greedy", "sampling"])
def test_a_requests_acceptance_carries_across_tree_shapes(kind):
    shapes = {
        TreeShape(*map(int, name.split(",")), stochastic=kind == "sampling"): means
        for name, means in MEASURED[kind].items()
    }
    assert len(shapes) == 4 and all(len(means) == 33 for means in shapes.values())
    for source, target in itertools.permutations(shapes, 2):
        predicted = [expected_accepted(alpha_for(m, source), target) for m in shapes[source]]
        ratio = sum(predicted) / sum(shapes[target])
        assert 0.9 < ratio < 1.1, (source, target, ratio)
