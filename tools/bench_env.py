"""What every `specrun bench` result carries: where it ran (the device's or CPU's name, thread
count, torch, Triton and CUDA versions, the date, the command line) and how its tables print
numbers."""

from __future__ import annotations

import datetime
import platform
import shlex
import sys
from pathlib import Path

import torch


def environment(device: str = "cuda") -> dict:
    """Where a benchmark ran: the device's name (the CPU's model on the CPU) and versions."""
    on_cuda = device.startswith("cuda")
    return {
        "device": torch.cuda.get_device_name(device) if on_cuda else cpu_name(),
        "num_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": triton_version(),
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["specrun", *sys.argv[1:]]),
    }


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.partition(":")[2].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or "cpu"


def triton_version() -> str | None:
    """Triton's version, None where it is not installed."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def fmt(value: float | None, spec: str = ".1f") -> str:
    """`value` formatted by `spec`, "-" for None (a table cell)."""
    return "-" if value is None else format(value, spec)
