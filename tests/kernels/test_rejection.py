"""rt::rejection_walk (the Triton walk) against rejection_walk_ref (the PyTorch walk).

CPU tier: the argument checks, opcheck, and the kernel under TRITON_INTERPRET=1 (in a
subprocess) on random trees: draft distributions far from and equal to the target's, children
with no draft mass, leaves without a draft row, one and several vocabulary chunks. GPU tier
(`-m gpu`): the kernel at the sizes of a (6, 8, 40) round of SmolLM2 with an EAGLE-3 head, and
inside a CUDA graph.
"""

from __future__ import annotations

import sys

import pytest
import torch
from triton_interpreter import assert_script_passes_under_interpreter

from specrun.runtime.kernels.rejection import (
    rejection_walk,
    rejection_walk_ref,
)


def random_walk_inputs(
    *,
    batch: int,
    num_nodes: int,
    depth: int,
    topk: int,
    vocab_size: int,
    draft_vocab_size: int,
    seed: int,
    closeness: float = 0.5,
    device: str = "cpu",
) -> tuple[torch.Tensor, ...]:
    """Random trees of at most `depth` levels and `topk` children per node (children after
    their parents, distinct draft ids among siblings), target distributions, and draft
    distributions mixing each node's target mass on the draft vocabulary (weight
    `closeness`) with noise; some children have no draft mass and some leaves no draft row."""
    gen = torch.Generator().manual_seed(seed)
    draft_to_target = torch.randperm(vocab_size, generator=gen)[:draft_vocab_size]
    logits = 3 * torch.randn(batch, num_nodes, vocab_size, generator=gen)
    probs = logits.softmax(-1)
    noise = (3 * torch.randn(batch, num_nodes, draft_vocab_size, generator=gen)).softmax(-1)
    near = probs[..., draft_to_target]
    draft_probs = closeness * near / near.sum(-1, keepdim=True) + (1 - closeness) * noise
    parent = torch.zeros(batch, num_nodes, dtype=torch.int64)
    node_draft_id = torch.zeros(batch, num_nodes, dtype=torch.int64)
    node_row = torch.arange(num_nodes).repeat(batch, 1)
    for b in range(batch):
        level_of, children = [0], {0: []}
        for node in range(1, num_nodes):
            open_parents = [p for p in children if level_of[p] < depth and len(children[p]) < topk]
            p = open_parents[int(torch.randint(len(open_parents), (1,), generator=gen))]
            draws = torch.multinomial(draft_probs[b, p], topk, generator=gen).tolist()
            taken = {int(node_draft_id[b, c]) for c in children[p]}
            x = next(d for d in draws if d not in taken)
            if torch.rand((), generator=gen) < 0.1:
                draft_probs[b, p, x] = 0.0  # a draw past q's support: skipped
            node_draft_id[b, node] = x
            parent[b, node] = p
            level_of.append(level_of[p] + 1)
            children[p].append(node)
            children[node] = []
        for node, kids in children.items():
            if not kids and torch.rand((), generator=gen) < 0.5:
                node_row[b, node] = -1
    uniforms = torch.rand(batch, depth, topk, generator=gen)
    args = (probs, parent, node_row, node_draft_id, draft_probs, draft_to_target, uniforms)
    return tuple(t.to(device) for t in args)


def assert_walks_agree(got, want) -> None:
    path, num_accepted, residual, residual_out = (t.cpu() for t in got)
    want_path, want_accepted, want_residual, want_out = want
    assert torch.equal(path, want_path), (path, want_path)
    assert torch.equal(num_accepted, want_accepted)
    torch.testing.assert_close(residual, want_residual, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(residual_out, want_out, rtol=1e-4, atol=1e-6)


def test_the_reference_accepts_every_draft_when_the_draft_is_the_target():
    args = random_walk_inputs(
        batch=3, num_nodes=9, depth=3, topk=2, vocab_size=40, draft_vocab_size=40, seed=0,
        closeness=1.0,
    )  # fmt: skip
    probs, parent, node_row, node_draft_id, draft_probs, _, uniforms = args
    identity = torch.arange(40)
    # Each node's draft is its target distribution, on an identity draft vocabulary.
    draft_probs = probs.clone()
    args = (probs, parent, node_row.abs(), node_draft_id, draft_probs, identity, uniforms)
    path, num_accepted, _, _ = rejection_walk_ref(*args)
    depth_of = torch.zeros_like(parent)
    for node in range(1, parent.shape[1]):
        depth_of[:, node] = depth_of.gather(1, parent[:, node : node + 1])[:, 0] + 1
    # The walk goes down as long as the node it stands on has children.
    last = path[:, -1]
    has_children = (parent == last[:, None]) & (torch.arange(parent.shape[1]) > 0)
    assert ((~has_children.any(1)) | (num_accepted == 3)).all()
    assert torch.equal(num_accepted, depth_of.gather(1, last[:, None])[:, 0])


def test_the_op_on_the_cpu_is_the_reference():
    args = random_walk_inputs(
        batch=2, num_nodes=13, depth=4, topk=3, vocab_size=50, draft_vocab_size=30, seed=1
    )
    assert_walks_agree(rejection_walk(*args), rejection_walk_ref(*args))


def test_opcheck():
    args = random_walk_inputs(
        batch=2, num_nodes=7, depth=3, topk=2, vocab_size=20, draft_vocab_size=12, seed=2
    )
    torch.library.opcheck(torch.ops.rt.rejection_walk.default, args)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: (a[0].double(), *a[1:]), "probs must be float32"),
        (lambda a: (a[0], a[1].int(), *a[2:]), "parent must be"),
        (lambda a: (*a[:5], a[5][:-1], a[6]), "draft_to_target must be"),
        (lambda a: (*a[:6], a[6][:1]), "differ in batch"),
        (lambda a: (a[0][0], *a[1:]), "takes probs"),
    ],
)
def test_bad_arguments_are_refused(change, message):
    args = random_walk_inputs(
        batch=2, num_nodes=7, depth=3, topk=2, vocab_size=20, draft_vocab_size=12, seed=3
    )
    with pytest.raises(ValueError, match=message):
        rejection_walk(*change(args))


def test_triton_kernel_under_interpreter():
    assert_script_passes_under_interpreter(__file__)


INTERPRET_CASES = (
    # (batch, nodes, depth, topk, vocab, draft vocab, closeness)
    (6, 11, 3, 3, 60, 37, 0.9),
    (4, 17, 4, 4, 300, 300, 0.95),
    (3, 9, 2, 8, 100, 64, 0.0),
    (1, 1, 2, 2, 10, 5, 0.5),
    (3, 21, 5, 4, 5000, 4500, 0.97),
)


def _interpret_main() -> int:
    """Run as a script under TRITON_INTERPRET=1: the kernel on the CPU vs the reference."""
    from specrun.runtime.kernels.rejection_triton import launch_rejection_walk

    failures = 0
    for seed, (batch, nodes, depth, topk, vocab, draft_vocab, closeness) in enumerate(
        INTERPRET_CASES
    ):
        args = random_walk_inputs(
            batch=batch, num_nodes=nodes, depth=depth, topk=topk, vocab_size=vocab,
            draft_vocab_size=draft_vocab, seed=seed, closeness=closeness,
        )  # fmt: skip
        try:
            assert_walks_agree(launch_rejection_walk(*args), rejection_walk_ref(*args))
        except AssertionError as e:
            failures += 1
            print(f"case {seed} {INTERPRET_CASES[seed]}: {e}")
    return failures


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("closeness", [0.0, 0.7, 0.95])
@pytest.mark.parametrize("batch", [1, 5])
def test_gpu_kernel_matches_reference_at_round_sizes(batch, closeness):
    args = random_walk_inputs(
        batch=batch, num_nodes=40, depth=6, topk=8, vocab_size=49152, draft_vocab_size=8192,
        seed=batch, closeness=closeness, device="cuda",
    )  # fmt: skip
    want = rejection_walk_ref(*(t.cpu() for t in args))
    assert_walks_agree(rejection_walk(*args), want)


@pytest.mark.gpu
@needs_cuda
def test_gpu_kernel_replays_in_a_cuda_graph():
    args = random_walk_inputs(
        batch=2, num_nodes=33, depth=5, topk=6, vocab_size=3000, draft_vocab_size=2500,
        seed=7, closeness=0.8, device="cuda",
    )  # fmt: skip
    rejection_walk(*args)  # compiles the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rejection_walk(*args)
    fresh = random_walk_inputs(
        batch=2, num_nodes=33, depth=5, topk=6, vocab_size=3000, draft_vocab_size=2500,
        seed=8, closeness=0.8, device="cuda",
    )  # fmt: skip
    for static, new in zip(args, fresh, strict=True):
        static.copy_(new)
    graph.replay()
    assert_walks_agree(out, rejection_walk_ref(*(t.cpu() for t in fresh)))


if __name__ == "__main__":
    sys.exit(_interpret_main())
