"""Shared pytest fixtures."""

from __future__ import annotations

import pytest
import torch

from specrun.models.llama import Llama
from tiny_models import random_llama, tiny_config


@pytest.fixture(scope="session")
def smollm_dir(tmp_path_factory):
    """The embedded SmolLM2-135M-Instruct, converted once per test session."""
    from specrun.models.default import default_model_dir

    return default_model_dir(root=tmp_path_factory.getbasetemp() / "specrun-cache")


@pytest.fixture
def uncached_compiles():
    """Fresh Dynamo state and no FX-graph / AOTAutograd cache hits, so passes run and count."""
    torch._dynamo.reset()
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
        torch.no_grad(),
    ):
        yield
    torch._dynamo.reset()


@pytest.fixture
def fresh_seeds(monkeypatch):
    """Unseeded requests get their fresh seeds from a seeded generator instead of the OS, so
    tests of what only unseeded requests do (stochastic trees) are reproducible."""
    import random

    from specrun.runtime import rng

    monkeypatch.setattr(rng.secrets, "randbits", random.Random(0).getrandbits)


@pytest.fixture
def tiny_llama() -> Llama:
    return random_llama(tiny_config(), dtype=torch.float64)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run on the GPU machine (`pytest -m gpu`); elsewhere they are skipped."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
