"""Shared pytest fixtures."""

from __future__ import annotations

import pytest
import torch

from specrun.models.llama import Llama
from tiny_models import random_llama, tiny_config


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
