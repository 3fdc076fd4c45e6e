"""Checking a test module's Triton kernels without a GPU: run under TRITON_INTERPRET=1, and
compiled for sm_90."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest


def assert_script_passes_under_interpreter(script: str) -> None:
    """Run `script` (a test module whose `__main__` checks Triton kernels against their
    reference) with TRITON_INTERPRET=1 in a subprocess, so the variable never reaches the
    triton this process imported; it must exit 0. The script sees tests/ on its path, as the
    test modules do under pytest."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    result = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr


def compile_for_hopper(
    kernel,
    signature: dict[str, str],
    constexprs: dict[str, object],
    *,
    num_warps: int = 4,
    num_stages: int = 3,
) -> str:
    """Compile a `@triton.jit` kernel to PTX for sm_90 on this machine (no GPU needed) and
    return the PTX: what the interpreter cannot check (names defined on every path of a
    branch Triton compiles, types at each pointer, a pipeline's shape). signature: each
    runtime argument's Triton type ("*bf16", "i32", ...); constexprs: the constexpr
    arguments' values."""
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    full_signature = {name: signature.get(name, "constexpr") for name in names}
    source = ASTSource(
        kernel,
        signature=full_signature,
        constexprs={(names.index(name),): value for name, value in constexprs.items()},
    )
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
