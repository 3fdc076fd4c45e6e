"""`specrun serve` options into the engine config: per-bucket trees, static batching, eager
rounds and tensor parallelism."""

from __future__ import annotations

import argparse

import pytest

from specrun.runtime.tree import TreeShape
from specrun.tools import serve


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_tree_at_replaces_the_table_from_its_bucket_up():
    config = serve.engine_config(
        _args("--tree", "5", "4", "8", "--tree-at", "4=3,2,4", "--tree-at", "16=none"),
        None,
    )
    assert config.tree_for(1) == config.tree_for(2) == TreeShape(5, 4, 8)
    assert config.tree_for(4) == config.tree_for(8) == TreeShape(3, 2, 4)
    assert config.tree_for(16) is config.tree_for(64) is None
    assert config.continuous_batching


def test_static_batches():
    assert not serve.engine_config(_args("--static-batches"), None).continuous_batching


def test_tp_splits_the_model_and_not_the_random_8b_one():
    assert serve.engine_config(_args("--tp", "2"), None).tensor_parallel == 2
    assert serve.engine_config(_args(), None).tensor_parallel == 1
    with pytest.raises(ValueError, match="--random-8b runs in one process"):
        serve.run(_args("--random-8b", "--tp", "2"))


def test_no_compile_runs_eager_rounds():
    assert serve.engine_config(_args("--no-compile"), None).compile is False
    assert serve.engine_config(_args(), None).compile is None


@pytest.mark.parametrize("bad", ["16", "x=none", "4=3,2", "4=0,1,1"])
def test_a_bad_tree_at_is_refused(bad, capsys):
    with pytest.raises(SystemExit):
        _args("--tree-at", bad)
    assert "--tree-at" in capsys.readouterr().err
