"""Minimal reproduction of the AOTInductor load crash: `python -m specrun.tools.aoti_probe`.

Compiles a 16x16 Linear + ReLU with `torch._inductor.aoti_compile_and_package` and loads the
package in fresh processes (a segfault kills only that process), step by step, to find the
layer that crashes:

- `compile`: export + AOTInductor package;
- `metadata`: the package's metadata through the C++ package loader (unzip only);
- `runner`: the wrapper .so unzipped by hand and opened with `AOTIModelContainerRunner{Cpu,
  Cuda}` directly, bypassing the package loader (`ldd -r` output first);
- `load`: `torch._inductor.aoti_load_package`, then a call compared with eager;
- `load_single_threaded`: the same with `run_single_threaded=True`.

Each step prints one JSON line: its name, the exit code (-11 is SIGSEGV) and the last lines of
its output (faulthandler's Python stack on a crash). Findings are in README.md ("Ahead-of-time
artifacts").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

_PRELUDE = """
import faulthandler, glob, json, os, sys, zipfile
import torch
faulthandler.enable()
device, package = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()).to(device).eval()
x = torch.randn(4, 16, device=device)
"""

STEPS = {
    "compile": """
        exported = torch.export.export(model, (x,))
        path = torch._inductor.aoti_compile_and_package(exported, package_path=package)
        print("package", path, os.path.getsize(path), "bytes")
    """,
    "metadata": """
        loader = torch._C._aoti.AOTIModelPackageLoader
        print(loader.load_metadata_from_package(package, "model"))
    """,
    "runner": """
        unpacked = package + ".unpacked"
        zipfile.ZipFile(package).extractall(unpacked)
        library = glob.glob(unpacked + "/**/*.wrapper.so", recursive=True)[0]
        os.system(f"ldd -r {library} 2>&1 | grep -v -E 'aoti_torch|=> /' | head -8")
        print("constructing the container runner", flush=True)
        if device == "cpu":
            runner = torch._C._aoti.AOTIModelContainerRunnerCpu(library, 1)
        else:
            runner = torch._C._aoti.AOTIModelContainerRunnerCuda(library, 1, device)
        print("constructed", flush=True)
        (out,) = runner.run([x])  # the weights are constants inside the library
        print("max |runner - eager|", float((out - model(x)).abs().max()))
    """,
    "load": """
        compiled = torch._inductor.aoti_load_package(package)
        print("loaded", flush=True)
        print("max |aoti - eager|", float((compiled(x) - model(x)).abs().max()))
    """,
    "load_single_threaded": """
        compiled = torch._inductor.aoti_load_package(package, run_single_threaded=True)
        print("loaded", flush=True)
        print("max |aoti - eager|", float((compiled(x) - model(x)).abs().max()))
    """,
}


def run_step(name: str, device: str, package: Path, *, timeout: float) -> dict:
    """One step in a fresh Python process; returns {step, device, rc, tail}."""
    code = (
        _PRELUDE + "with torch.no_grad():\n" + textwrap.indent(textwrap.dedent(STEPS[name]), "    ")
    )
    command = [sys.executable, "-c", code, device, str(package)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        rc, output = "timeout", ""
    lines = [line for line in output.splitlines() if "Warning" not in line]
    return {"step": name, "device": device, "rc": rc, "tail": lines[-12:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", nargs="+", default=["cpu", "cuda"])
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per step")
    args = parser.parse_args(argv)
    print(json.dumps({"torch": _torch_version(), "python": sys.version.split()[0]}))
    with tempfile.TemporaryDirectory(prefix="aoti-probe-") as work:
        for device in args.devices:
            package = Path(work) / f"linear_relu_{device}.pt2"
            for name in STEPS:
                result = run_step(name, device, package, timeout=args.timeout)
                print(json.dumps(result), flush=True)
                if name == "compile" and result["rc"] != 0:
                    break
    return 0


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    sys.exit(main())
