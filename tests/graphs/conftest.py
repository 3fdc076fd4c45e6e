"""Fixtures for compile tests: every compile really runs (no cached graphs skip the passes)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
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
