"""Shared pytest fixtures."""

from __future__ import annotations

import pytest
import torch

from specrun.models.llama import Llama
from tiny_models import random_llama, tiny_config


@pytest.fixture
def tiny_llama() -> Llama:
    return random_llama(tiny_config(), dtype=torch.float64)
