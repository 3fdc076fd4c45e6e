"""rt::acceptance_signals against its reference (the root's gathered target logits, their
log-softmax and the draft's confidence and KL divergence in plain PyTorch).

CPU tier: the reference against the definition on hypothesis-drawn rows, the argument checks,
opcheck, and the Triton kernel under TRITON_INTERPRET=1 (in a subprocess) and compiled for
sm_90. GPU tier (`-m gpu`): the kernel at SmolLM2's shapes and odd ones, and in a CUDA graph.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_interpreter import assert_script_passes_under_interpreter, compile_for_hopper

from specrun.runtime.kernels.acceptance_signals import (
    MAX_KL,
    acceptance_signals,
    acceptance_signals_ref,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_operands(batch, vocab, num_draft, *, dtype, seed, device="cpu"):
    """Target logits [B, V], draft logits [B, V_draft], a map of distinct target ids and the
    draft rows' logsumexp; the draft close to the target on its ids, as a trained head is."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, vocab, generator=gen) * 3
    ids = torch.randperm(vocab, generator=gen)[:num_draft]
    draft = target[:, ids] + 0.5 * torch.randn(batch, num_draft, generator=gen)
    target, draft = target.to(dtype), draft.to(dtype)
    norm = draft.float().logsumexp(-1)
    return tuple(t.to(device) for t in (target, draft, ids, norm))


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    vocab=st.integers(2, 300),
    fraction=st.floats(0.1, 1.0),
    seed=st.integers(0, 2**16),
)
def test_reference_is_the_definition(batch, vocab, fraction, seed):
    """Confidence is q's top probability; KL is sum p log(p / q) with p the target's softmax
    over the draft's ids, both in float64."""
    num_draft = max(1, int(vocab * fraction))
    target, draft, ids, norm = make_operands(batch, vocab, num_draft, dtype=torch.float32,
                                             seed=seed)  # fmt: skip
    got = acceptance_signals(target, draft, ids, norm)
    q = draft.double().softmax(-1)
    p = target.double()[:, ids].softmax(-1)
    want_kl = (p * (p / q).log()).sum(-1).clamp(0.0, MAX_KL)
    torch.testing.assert_close(got[:, 0].double(), q.amax(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[:, 1].double(), want_kl, rtol=1e-4, atol=1e-5)


def test_ruled_out_entries_add_nothing_and_an_impossible_draft_is_clamped():
    target = torch.tensor([[0.0, float("-inf"), 1.0, 2.0], [float("-inf")] * 4])
    draft = torch.tensor([[0.0, 0.0, 1.0, 2.0], [0.0, 1.0, 2.0, 3.0]])
    ids = torch.arange(4)
    norm = draft.logsumexp(-1)
    got = acceptance_signals(target, draft, ids, norm)
    # Row 0: p on {0, 2, 3} as q is there, q also on 1: KL = -log q({0, 2, 3}).
    mass = draft[0, [0, 2, 3]].exp().sum() / draft[0].exp().sum()
    torch.testing.assert_close(got[0, 1], -mass.log(), rtol=1e-5, atol=1e-6)
    assert got[1, 1] == 0.0  # the target rules out every draft id: no KL to speak of
    impossible = draft.clone()
    impossible[0, 3] = float("-inf")
    assert acceptance_signals(target, impossible, ids, impossible.logsumexp(-1))[0, 1] == MAX_KL


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "target": a["target"][0]}, "target logits"),
        (lambda a: {**a, "target": a["target"][:1]}, "one row of each"),
        (lambda a: {**a, "ids": a["ids"].int()}, "int64"),
        (lambda a: {**a, "ids": a["ids"][:3]}, "draft_to_target"),
        (lambda a: {**a, "norm": a["norm"].double()}, "float32"),
        (lambda a: {**a, "draft": a["draft"].long()}, "floating-point"),
    ],
)
def test_bad_arguments_are_refused(change, message):
    target, draft, ids, norm = make_operands(2, 50, 20, dtype=torch.float32, seed=0)
    args = change(dict(target=target, draft=draft, ids=ids, norm=norm))
    with pytest.raises(ValueError, match=message):
        acceptance_signals(args["target"], args["draft"], args["ids"], args["norm"])


def test_opcheck():
    target, draft, ids, norm = make_operands(2, 60, 25, dtype=torch.bfloat16, seed=1)
    torch.library.opcheck(torch.ops.rt.acceptance_signals.default, (target, draft, ids, norm))


def test_triton_kernel_under_interpreter():
    assert_script_passes_under_interpreter(__file__)


def test_triton_kernel_compiles_for_hopper():
    from specrun.runtime.kernels.acceptance_signals_triton import (
        _BLOCK,
        _acceptance_signals_kernel,
    )

    signature = dict(target_ptr="*bf16", draft_ptr="*bf16", ids_ptr="*i64", norm_ptr="*fp32",
                     out_ptr="*fp32", num_draft="i32", stride_t="i32", stride_d="i32")  # fmt: skip
    ptx = compile_for_hopper(
        _acceptance_signals_kernel, signature, dict(MAX_KL=MAX_KL, BLOCK=_BLOCK)
    )
    assert "ex2" in ptx  # the exponentials of the online log-sum-exp


INTERPRET_CASES = (
    # (batch, vocab, draft vocabulary, dtype): one entry, a partial step, several steps,
    # bf16 rows, a row read through strides (the root's logits of a [B, T, V] tensor)
    (1, 5, 1, torch.float32),
    (2, 300, 100, torch.float32),
    (3, 6000, 4500, torch.float32),
    (2, 3000, 2049, torch.bfloat16),
)


def _interpret_main() -> int:
    """Run as a script under TRITON_INTERPRET=1: the kernel on the CPU against the reference,
    with entries the target rules out, an impossible draft entry and a row without mass."""
    from specrun.runtime.kernels.acceptance_signals_triton import launch_acceptance_signals

    failures = 0
    for i, (batch, vocab, num_draft, dtype) in enumerate(INTERPRET_CASES):
        target, draft, ids, norm = make_operands(batch, vocab, num_draft, dtype=dtype, seed=i)
        if i == 1:
            target[0, ids[::7]] = float("-inf")
            target[1] = float("-inf")
        if i == 2:
            draft[1, 3] = float("-inf")
        if i == 3:
            target = torch.stack([target, target.flip(-1)], dim=1)[:, 0]  # row stride 2V
        got = launch_acceptance_signals(target, draft, ids, norm)
        want = acceptance_signals_ref(target, draft, ids, norm)
        ok = torch.allclose(got, want, rtol=1e-4, atol=1e-5)
        failures += not ok
        print(f"case {i}: {batch}x{num_draft} of {vocab} {'ok' if ok else f'FAIL {got} {want}'}")
    return 1 if failures else 0


# GPU tier ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("batch", "vocab", "num_draft"),
    [(1, 49152, 14336), (4, 49152, 14336), (3, 128256, 32000), (2, 700, 333)],
    ids=["smollm2-b1", "smollm2-b4", "8b", "odd"],
)
def test_gpu_kernel_matches_reference(batch, vocab, num_draft):
    target, draft, ids, norm = make_operands(batch, vocab, num_draft, dtype=torch.bfloat16,
                                             seed=vocab, device="cuda")  # fmt: skip
    got = acceptance_signals(target, draft, ids, norm)
    torch.testing.assert_close(got, acceptance_signals_ref(target, draft, ids, norm),
                               rtol=1e-4, atol=1e-5)  # fmt: skip


@pytest.mark.gpu
@needs_cuda
def test_gpu_under_compile_and_in_a_cuda_graph():
    target, draft, ids, norm = make_operands(2, 49152, 14336, dtype=torch.bfloat16, seed=5,
                                             device="cuda")  # fmt: skip
    compiled = torch.compile(acceptance_signals, fullgraph=True)
    want = acceptance_signals_ref(target, draft, ids, norm)
    torch.testing.assert_close(compiled(target, draft, ids, norm), want, rtol=1e-4, atol=1e-5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = acceptance_signals(target, draft, ids, norm)
    target.copy_(target.flip(-1))
    graph.replay()
    want = acceptance_signals_ref(target, draft, ids, norm)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
    sys.exit(_interpret_main())
