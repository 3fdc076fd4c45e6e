"""Whether Triton is importable, and how the `rt::` ops are defined with or without it.

Triton is a Linux-only dependency (pyproject), yet `specrun.runtime` must import and decode
on the CPU everywhere (macOS, Windows, CPU-only containers). So the kernel modules
(tree_attention.py, topk.py, rejection.py) hold only what runs anywhere: each op's signature
and body, its plain-PyTorch `*_ref` and its CPU kernel. Their `@triton.jit` kernels and
launchers live in `*_triton.py` modules next to them, imported by the launchers on first
use, which only happens for CUDA tensors with Triton present (`uses_triton`).

The ops exist either way, with the reference as their CPU kernel and their body as their
fake impl, so that FX passes can insert them into CPU graphs and those graphs run:

- with Triton, `rt_op` is `torch.library.triton_op`, as the kernel modules always used:
  torch.compile decomposes the op into its body, so Inductor sees the Triton kernels (or, on
  the CPU, the reference's ATen ops) rather than an opaque call; unless the op asks to stay
  opaque (`opaque_with`): then compiled graphs call it;
- without it, a plain `torch.library.custom_op` with the same body: there is no kernel to
  inline, compiled graphs call the op, and every device runs the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.library import CustomOpDef, custom_op, triton_op, wrap_triton

try:
    import triton
except ImportError:  # not installed (non-Linux, CPU-only): the references run everywhere
    triton = None

HAS_TRITON = triton is not None


def uses_triton(device: torch.device) -> bool:
    """Whether an op launches its Triton kernels for tensors on `device` (else the
    reference runs): CUDA tensors, when Triton is installed."""
    return HAS_TRITON and device.type == "cuda"


def rt_op(
    name: str, *, opaque_with: Callable[..., Any] | None = None
) -> Callable[[Callable[..., Any]], CustomOpDef]:
    """Decorator defining the functional op `name` ("rt::...") from its body, which must
    also serve as its fake impl (take the reference unless `uses_triton`).

    opaque_with: a reference that computes the op on any tensors: the op is then a plain
    custom op even with Triton, with that as its fake impl, so compiled graphs call it (its
    launcher runs when the graph runs) rather than inlining its kernels. For ops whose
    launcher hands the kernels a buffer that lives across launches (arrivals.py), which a
    traced launcher could only allocate anew in every call."""
    if HAS_TRITON and opaque_with is None:
        return triton_op(name, mutates_args=())

    def define(body: Callable[..., Any]) -> CustomOpDef:
        op = custom_op(name, body, mutates_args=())
        op.register_fake(opaque_with or body)
        return op

    return define


def wrap(kernel: Any) -> Any:
    """wrap_triton, except for TRITON_INTERPRET kernels (older torch rejects those)."""
    return wrap_triton(kernel) if isinstance(kernel, triton.runtime.JITFunction) else kernel
