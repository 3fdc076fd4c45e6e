"""Tree construction against a plain loop over EAGLE-2's description; bitmask invariants."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrun.models.attention import expand_ancestor_mask, pack_ancestor_mask
from specrun.runtime.draft import frontier_visibility
from specrun.runtime.tree import (
    Candidates,
    StaticTree,
    TreeShape,
    ancestor_bitmask,
    expand_level,
    first_level,
    log_norm_from_top,
    rerank,
)


def _draft_tables(shape: TreeShape, vocab: int, seed: int) -> tuple[torch.Tensor, list]:
    """Draft logits: the root's [V] and each later level's [K, V]."""
    gen = torch.Generator().manual_seed(seed)
    root_logits = 3 * torch.randn(vocab, generator=gen)
    level_logits = [
        3 * torch.randn(shape.topk, vocab, generator=gen) for _ in range(shape.depth - 1)
    ]
    return root_logits, level_logits


def _loop_tree(shape: TreeShape, root_logits, level_logits):
    """EAGLE-2 as written in prose: (token, score, parent candidate, level) per candidate."""
    root_logp = root_logits.log_softmax(-1)
    level_logp = [logits.log_softmax(-1) for logits in level_logits]
    cands = []
    order = sorted(range(len(root_logp)), key=lambda t: -float(root_logp[t]))[: shape.topk]
    frontier = []
    for t in order:
        cands.append((t, float(root_logp[t]), -1, 1))
        frontier.append(len(cands) - 1)
    for level, logp in enumerate(level_logp, start=2):
        children = []
        for f_rank, f in enumerate(frontier):
            row = logp[f_rank]
            best = sorted(range(len(row)), key=lambda t: -float(row[t]))[: shape.topk]
            for t in best:
                children.append((t, cands[f][1] + float(row[t]), f, level))
        start = len(cands)
        cands.extend(children)
        ranked = sorted(range(len(children)), key=lambda i: -children[i][1])[: shape.topk]
        frontier = [start + i for i in ranked]
    kept = sorted(sorted(range(len(cands)), key=lambda i: -cands[i][1])[: shape.num_nodes - 1])
    node_of = {c: n + 1 for n, c in enumerate(kept)}
    tokens = [cands[c][0] for c in kept]
    parents = [node_of.get(cands[c][2], 0) for c in kept]
    depths = [cands[c][3] for c in kept]
    return tokens, parents, depths


@st.composite
def tree_shapes(draw):
    depth, topk = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    num_candidates = topk + (depth - 1) * topk**2
    return TreeShape(depth, topk, draw(st.integers(1, min(64, num_candidates + 1))))


@settings(max_examples=40, deadline=None)
@given(shape=tree_shapes(), seed=st.integers(0, 10_000))
def test_dynamic_tree_matches_loop(shape, seed):
    vocab = 40
    root_logits, level_logits = _draft_tables(shape, vocab, seed)
    tokens, scores = first_level(root_logits[None], shape.topk)
    all_tokens, all_scores = [tokens], [scores]
    all_parents = [torch.full((1, shape.topk), -1)]
    frontier_cand, frontier_scores, offset = torch.arange(shape.topk)[None], scores, shape.topk
    for logits in level_logits:
        tokens, scores, parent, nxt = expand_level(frontier_scores, logits[None], shape.topk)
        all_tokens.append(tokens)
        all_scores.append(scores)
        all_parents.append(frontier_cand.gather(1, parent))
        frontier_cand = offset + nxt
        frontier_scores = scores.gather(1, nxt)
        offset += shape.topk**2
    cands = Candidates(
        torch.cat(all_tokens, 1), torch.cat(all_scores, 1), torch.cat(all_parents, 1)
    )
    tree = rerank(torch.tensor([7]), cands, shape)
    want_tokens, want_parents, want_depths = _loop_tree(shape, root_logits, level_logits)
    assert tree.tokens[0].tolist() == [7, *want_tokens]
    assert tree.parent[0].tolist() == [0, *want_parents]
    assert tree.depth[0].tolist() == [0, *want_depths]
    _check_bitmask(tree.anc, tree.parent, tree.depth)


def _check_bitmask(anc, parent, depth):
    num_nodes = parent.shape[1]
    mask = expand_ancestor_mask(anc, num_nodes)[0]
    for i in range(num_nodes):
        assert mask[i, i] and mask[i, 0]
        p = int(parent[0, i])
        assert p < i or i == 0
        if i:
            assert int(depth[0, i]) == int(depth[0, p]) + 1
            # closed under parents: i's ancestors are p's ancestors plus i itself
            expected = mask[p].clone()
            expected[i] = True
            assert torch.equal(mask[i], expected)


def test_bitmask_spans_several_words():
    num_nodes = 130
    parent = torch.tensor([[0, *range(num_nodes - 1)]])
    anc = ancestor_bitmask(parent, max_depth=num_nodes)
    assert anc.shape == (1, num_nodes, 3)
    mask = expand_ancestor_mask(anc, num_nodes)[0]
    assert torch.equal(mask, torch.ones(num_nodes, num_nodes).tril().bool())


@settings(max_examples=30, deadline=None)
@given(
    num_side=st.integers(0, 140),
    topk=st.integers(1, 10),
    batch=st.integers(1, 3),
    seed=st.integers(0, 10_000),
)
def test_frontier_visibility_adds_each_node_to_its_packed_ancestors(num_side, topk, batch, seed):
    """Packed words in, packed words out: the same mask as unpacking the ancestors,
    appending the identity and packing again, across word boundaries (bit 63 included)."""
    gen = torch.Generator().manual_seed(seed)
    ancestors = torch.rand(batch, topk, num_side, generator=gen) < 0.5
    anc = pack_ancestor_mask(ancestors) if num_side else torch.zeros(batch, topk, 0).long()
    itself = torch.eye(topk, dtype=torch.bool).expand(batch, -1, -1)
    want = pack_ancestor_mask(torch.cat([ancestors, itself], dim=-1))
    assert torch.equal(frontier_visibility(anc, num_side), want)


@pytest.mark.parametrize("vocab", [1, 37, 3000])
def test_log_norm_from_top_is_the_logsumexp(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = (4 * torch.randn(3, vocab, generator=gen)).bfloat16()
    tokens, scores = first_level(logits, min(4, vocab))
    want = logits.float().logsumexp(-1)
    torch.testing.assert_close(log_norm_from_top(logits, tokens, scores), want)


def test_tree_shape_validation():
    with pytest.raises(ValueError, match="num_nodes"):
        TreeShape(depth=2, topk=2, num_nodes=8)
    with pytest.raises(ValueError, match="depth"):
        TreeShape(depth=0, topk=2, num_nodes=2)
    assert TreeShape(depth=7, topk=10, num_nodes=60).num_candidates == 610


def test_static_tree_structure():
    tree = StaticTree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert tree.num_nodes == 7 and tree.depth == 3 and tree.max_rank == 2
    assert tree.parent_nodes() == [0, 0, 0, 1, 1, 2, 3]
    with pytest.raises(ValueError, match="prefix"):
        StaticTree.from_paths([[0], [1, 0]])
