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
