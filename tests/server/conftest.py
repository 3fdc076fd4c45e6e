"""The HTTP tests' default server: `specrun serve` with the embedded model and its shipped
head on the CPU, shared by the tests of a module."""

from __future__ import annotations

from pathlib import Path

import pytest

import specrun
from http_server import start_server

HEAD = Path(specrun.__file__).parent / "models" / "heads" / "smollm2-135m-instruct-eagle3"


@pytest.fixture(scope="module")
def server(smollm_dir, tmp_path_factory):
    server = start_server(
        smollm_dir, tmp_path_factory,
        "--draft", str(HEAD), "--buckets", "1", "2", "4", "8", "--max-seq-len", "512",
        "--max-waiting", "64",
    )  # fmt: skip
    yield server
    server.stop()
