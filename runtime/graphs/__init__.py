"""Lowering: torch.compile with Inductor and specrun's passes (compile.py), CUDA-graph capture
and replay per bucket (runner.py)."""

from .compile import (
    CompiledStep,
    compile_draft,
    compile_prefill,
    compile_round,
    compile_step,
    compile_verify,
)
from .runner import CapturedGraph, CudaGraphRunner

__all__ = [
    "CapturedGraph",
    "CompiledStep",
    "CudaGraphRunner",
    "compile_draft",
    "compile_prefill",
    "compile_round",
    "compile_step",
    "compile_verify",
]
