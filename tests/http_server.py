"""A `specrun serve` subprocess on 127.0.0.1 for the HTTP tests (importable as
`http_server`): `start_server` launches one on the CPU and returns once it answers /health."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest

MODEL_NAME = "smollm2"
_START_SECONDS = 180


class Server:
    """A running server: its process, base URL, the model id it serves and its log file."""

    def __init__(self, process: subprocess.Popen, url: str, log: Path) -> None:
        self.process, self.url, self.log = process, url, log
        self.model = MODEL_NAME

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by its name with labels (`name{label="value"}`)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        lines = [line for line in text.splitlines() if line and not line.startswith("#")]
        samples = (line.rsplit(" ", 1) for line in lines)
        return {name: float(value) for name, value in samples}

    def metric(self, name: str) -> float:
        """One sample's value from /metrics."""
        samples = self.metrics()
        if name not in samples:
            raise KeyError(f"{name} not in /metrics")
        return samples[name]

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Until no request runs or waits (AssertionError after `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while self.metric("specrun_requests_running") or self.metric("specrun_requests_waiting"):
            assert time.monotonic() < deadline, "requests still running"
            time.sleep(0.02)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_server(
    model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    *extra_args: str,
    threads: int = 4,
    env: Mapping[str, str] | None = None,
) -> Server:
    """`specrun serve --model model_dir --device cpu *extra_args` on a free port, serving the
    model as "smollm2", with `threads` OpenMP threads and `env` over the environment; its
    output goes to `Server.log`."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    command = [
        sys.executable, "-m", "specrun.tools.cli", "serve", "--model", str(model_dir),
        "--device", "cpu", "--port", str(port), "--served-model-name", MODEL_NAME, *extra_args,
    ]  # fmt: skip
    with open(log, "w") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=os.environ | {"OMP_NUM_THREADS": str(threads), **(env or {})},
        )
    server = Server(process, f"http://127.0.0.1:{port}", log)
    _wait_healthy(server)
    return server


def _wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + _START_SECONDS
    while True:
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if server.process.poll() is not None or time.monotonic() > deadline:
            server.process.kill()
            raise RuntimeError(f"specrun serve did not start:\n{server.log.read_text()[-4000:]}")
        time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
