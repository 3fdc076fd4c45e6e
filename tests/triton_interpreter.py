"""Running a test module's Triton kernels on the CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


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
