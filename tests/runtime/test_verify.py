"""Tree acceptance: greedy walks the argmax; sampling emits exactly the target's law."""

from __future__ import annotations

import itertools

import torch

from goodness_of_fit import chi_square_p_value
from specrun.runtime.rng import Site
from specrun.runtime.sampling import sample
from specrun.runtime.tree import StaticTree, Tree, ancestor_bitmask
from specrun.runtime.verify import accept


def _static_tree(tokens_per_node: list[int], paths, batch: int) -> Tree:
    static = StaticTree.from_paths(paths)
    parent = torch.tensor(static.parent_nodes()).expand(batch, -1)
    depth = torch.tensor([0] + [len(p) for p in static.paths]).expand(batch, -1)
    tokens = torch.tensor(tokens_per_node).expand(batch, -1)
    return Tree(tokens, parent, depth, ancestor_bitmask(parent, max_depth=static.depth))


PATHS = [[0], [1], [0, 0], [0, 1], [1, 0]]
# node: 0 root, 1=[0], 2=[1], 3=[0,0], 4=[0,1], 5=[1,0]; tokens chosen so siblings differ
TOKENS = [9, 2, 0, 1, 3, 2]


def test_greedy_follows_argmax_and_stops_at_mismatch():
    tree = _static_tree(TOKENS, PATHS, batch=3)
    drawn = torch.tensor(
        [
            [2, 3, 0, 0, 0, 0],  # root->2 (node 1), node1 draws 3 -> node 4, bonus drawn[4]
            [0, 0, 1, 0, 0, 0],  # root->0 (node 2), node2 draws 1: no child 1 -> bonus 1
            [3, 0, 0, 0, 0, 0],  # root draws 3: no child -> bonus 3
        ]
    )
    result = accept(tree, drawn, depth=2)
    assert result.num_accepted.tolist() == [2, 1, 0]
    assert result.path.tolist() == [[0, 1, 4], [0, 2, 2], [0, 0, 0]]
    assert result.bonus.tolist() == [0, 1, 3]


def test_sampling_emits_the_target_distribution():
    vocab, batch = 4, 40_000
    gen = torch.Generator().manual_seed(0)
    probs_per_node = torch.rand(len(TOKENS), vocab, generator=gen) ** 2
    probs_per_node /= probs_per_node.sum(-1, keepdim=True)
    tree = _static_tree(TOKENS, PATHS, batch)
    seed = torch.stack([torch.arange(batch), torch.zeros(batch, dtype=torch.int64)], dim=1)
    counter = torch.arange(len(TOKENS)).expand(batch, -1)
    probs = probs_per_node.expand(batch, -1, -1).contiguous()
    drawn = sample(probs, seed, counter, site=Site.TARGET)
    result = accept(tree, drawn, depth=2)
    emitted = [
        (*(TOKENS[n] for n in path[1 : 1 + a]), bonus)
        for path, a, bonus in zip(
            result.path.tolist(), result.num_accepted.tolist(), result.bonus.tolist(), strict=True
        )
    ]
    expected = _exact_law(probs_per_node, tree)
    counts = {seq: 0 for seq in expected}
    for seq in emitted:
        counts[seq] += 1
    assert chi_square_p_value(counts, expected, batch) > 1e-3


def _exact_law(probs, tree: Tree) -> dict[tuple[int, ...], float]:
    """Probability of every sequence a single round can emit, by enumerating the walk."""
    children = {}
    for node in range(1, tree.tokens.shape[1]):
        children.setdefault(int(tree.parent[0, node]), {})[int(tree.tokens[0, node])] = node
    law: dict[tuple[int, ...], float] = {}

    def walk(node: int, prefix: tuple[int, ...], mass: float) -> None:
        for token, p in enumerate(probs[node].tolist()):
            child = children.get(node, {}).get(token)
            if child is None:
                law[(*prefix, token)] = law.get((*prefix, token), 0.0) + mass * p
            else:
                walk(child, (*prefix, token), mass * p)

    walk(0, (), 1.0)
    return law


def test_exact_law_sums_to_one():
    probs = torch.full((len(TOKENS), 4), 0.25)
    law = _exact_law(probs, _static_tree(TOKENS, PATHS, 1))
    assert abs(sum(law.values()) - 1) < 1e-9
    assert all(len(s) <= 3 for s in itertools.chain(law))
