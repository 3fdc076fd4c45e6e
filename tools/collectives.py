"""The collectives of a tensor-parallel round, recorded and then timed alone.

A rank's round launches the collectives of models/tensor_parallel.py: an all-reduce per
embedding lookup (the target's, and a borrowing draft head's at every draft step), two per
layer of each target forward (attention output and down projection) and the all-gather of
the vocabulary-parallel logits. `record_collectives` runs a step eagerly under a dispatch
mode that notes every `_c10d_functional` collective it launches (op, input shape and dtype,
and the op's other arguments: reduce op, group size, group name), so the count and sizes
come from the code that runs, not from a formula. `CollectiveReplay` launches the same
collectives in the same order on buffers of the same shapes (all-reduces in place) and waits
for each, nothing else: captured in a CUDA graph and replayed like the round
(`time_collectives`), it gives the time the round spends in communication when nothing
overlaps it.

Every rank must record and replay together (the collectives meet). On the CPU (gloo) the
recording and the replay run eagerly, timed on the host clock.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime.graphs import CudaGraphRunner
from .round_timing import time_replays

COLLECTIVE_NAMESPACE = "_c10d_functional"
# Completion, not communication: waiting is part of replaying each collective. (Private ops
# of the namespace, such as eager mode's autograd wrapping, are skipped too.)
NOT_COLLECTIVES = frozenset({"wait_tensor"})


@dataclass(frozen=True)
class Collective:
    """One collective a step launched.

    op: the functional collective (e.g. `_c10d_functional.all_reduce.default`).
    shape, dtype: its input tensor's.
    args: its other arguments, in order (reduce op, group size, group name).
    """

    op: torch._ops.OpOverload
    shape: tuple[int, ...]
    dtype: torch.dtype
    args: tuple[Any, ...]

    @property
    def name(self) -> str:
        """The op's name without namespace and overload: "all_reduce", ...."""
        return self.op._opname

    @property
    def num_bytes(self) -> int:
        """Bytes of this rank's input."""
        return torch.Size(self.shape).numel() * self.dtype.itemsize


class _Recorder(TorchDispatchMode):
    """Notes every functional collective dispatched while active, then runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_collective(func):
            self.collectives.append(_collective(func, args, kwargs))
        return func(*args, **kwargs)


def _is_collective(func: torch._ops.OpOverload) -> bool:
    name = func._opname
    return (
        func.namespace == COLLECTIVE_NAMESPACE
        and name not in NOT_COLLECTIVES
        and not name.startswith("_")
    )


def _collective(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Collective:
    """The Collective of one dispatched call (its first argument the input tensor)."""
    tensor, *rest = args
    if (
        not isinstance(tensor, torch.Tensor)
        or kwargs
        or any(isinstance(arg, (torch.Tensor, list, tuple)) for arg in rest)
    ):
        raise ValueError(
            f"{func} is not a single-tensor collective (input, then plain arguments); "
            "record_collectives replays only those"
        )
    return Collective(func, tuple(tensor.shape), tensor.dtype, tuple(rest))


def record_collectives(step: Callable[[], Any]) -> list[Collective]:
    """Run `step` once, eagerly, and return the collectives it launched, in order. The step
    runs for real: its buffers change as a call would change them."""
    recorder = _Recorder()
    with torch.inference_mode(), recorder:
        step()
    return recorder.collectives


def count_collectives(collectives: Sequence[Collective]) -> dict[str, int]:
    """How many of each kind: {"all_reduce": n, "all_gather_into_tensor": m, ...}."""
    return dict(collections.Counter(c.name for c in collectives))


class CollectiveReplay:
    """The recorded collectives alone, each on an input buffer of its own, each waited for.

    All-reduces run in place (`all_reduce_`, as compiled code runs them): the functional
    `all_reduce` first copies its input, a kernel the round's compiled collectives do not
    launch. The buffers start at ones, so an all-reduce over N ranks multiplies its buffer by
    N per call (finite in bfloat16 for over a hundred calls over 2 ranks).

    Args:
        collectives: what `record_collectives` returned (on every rank alike).
        device: where the buffers live (this rank's device).
    """

    def __init__(self, collectives: Sequence[Collective], *, device: torch.device | str) -> None:
        self.collectives = list(collectives)
        self.inputs = [torch.ones(c.shape, dtype=c.dtype, device=device) for c in collectives]

    def __call__(self) -> list[torch.Tensor]:
        """Launch and wait for every collective in order; returns their outputs (the
        all-reduces' buffers)."""
        functional = torch.ops._c10d_functional
        outputs = []
        for collective, tensor in zip(self.collectives, self.inputs, strict=True):
            op = functional.all_reduce_.default if collective.name == "all_reduce" else None
            out = (op or collective.op)(tensor, *collective.args)
            outputs.append(functional.wait_tensor.default(out))
        return outputs


def time_collectives(
    collectives: Sequence[Collective], *, device: torch.device | str, num_rounds: int
) -> float:
    """Mean seconds of the collectives alone, captured in one CUDA graph and replayed
    `num_rounds` times back to back (`time_replays`; on the CPU, eager calls); 0 without
    collectives. Every rank calls it with the same collectives."""
    if not collectives:
        return 0.0
    replay = CollectiveReplay(collectives, device=device)
    if torch.device(device).type != "cuda":
        with torch.inference_mode():
            return time_replays(replay, num_rounds=num_rounds, device=device)
    runner = CudaGraphRunner(device)
    try:
        with torch.inference_mode():
            runner.capture("collectives", replay)
        return time_replays(lambda: runner.replay("collectives"), num_rounds=num_rounds)
    finally:
        runner.close()
