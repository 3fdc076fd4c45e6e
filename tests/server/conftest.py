"""A `specrun serve` subprocess on 127.0.0.1 with the embedded model and its shipped head on
the CPU, shared by the HTTP tests of a module."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import specrun

HEAD = Path(specrun.__file__).parent / "models" / "heads" / "smollm2-135m-instruct-eagle3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, process: subprocess.Popen, url: str, model: str) -> None:
        self.process, self.url, self.model = process, url, model

    def metric(self, name: str) -> float:
        """A sample's value from /metrics (the first line that starts with `name `)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise KeyError(f"{name} not in /metrics")

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Until no request runs or waits (AssertionError after `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while self.metric("specrun_requests_running") or self.metric("specrun_requests_waiting"):
            assert time.monotonic() < deadline, "requests still running"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def server(smollm_dir, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    command = [
        sys.executable, "-m", "specrun.tools.cli", "serve", "--model", str(smollm_dir),
        "--draft", str(HEAD), "--device", "cpu", "--buckets", "1", "2", "4", "8",
        "--max-seq-len", "512", "--port", str(port), "--served-model-name", "smollm2",
        "--max-waiting", "64",
    ]  # fmt: skip
    with open(log, "w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=os.environ | {"OMP_NUM_THREADS": "4"}
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"specrun serve did not start:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    yield Server(process, url, "smollm2")
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
