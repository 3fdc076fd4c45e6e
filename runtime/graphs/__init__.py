"""Lowering: torch.compile with Inductor and specrun's passes (compile.py)."""

from .compile import (
    CompiledStep,
    compile_draft,
    compile_prefill,
    compile_round,
    compile_step,
    compile_verify,
)

__all__ = [
    "CompiledStep",
    "compile_draft",
    "compile_prefill",
    "compile_round",
    "compile_step",
    "compile_verify",
]
