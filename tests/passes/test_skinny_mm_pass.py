"""The skinny-mm replacement: a few static rows times a Linear's weight becomes `rt::skinny_mm`.

It fires on every projection of a decode step's target forward (q/k/v, output, gate/up, down
per layer) and the compiled step equals eager; it leaves alone more rows than the op takes,
float32, and devices it was not built for (by default the CPU, where the op's kernel is its
float32 reference). The CPU tests build the pass for "cpu"; the GPU tier runs the default
pass, whose op launches the Triton kernel, on a bf16 step.
"""

from __future__ import annotations

import pytest
import torch

from specrun.runtime.graphs import compile_verify
from specrun.runtime.passes import PassManager
from specrun.runtime.passes.skinny_mm import SkinnyMMReplacement
from tiny_models import assert_step_close, chained_step_inputs, random_llama, tiny_config

# Every compile must really run: cached graphs would skip the passes.
pytestmark = pytest.mark.usefixtures("uncached_compiles")

PROJECTIONS_PER_LAYER = 4  # fused q/k/v, output, fused gate/up, down


def _compiled_step(target, *, device_types=("cpu",)):
    manager = PassManager([SkinnyMMReplacement(device_types=device_types)])
    return compile_verify(target, manager=manager), manager


@pytest.mark.parametrize(("batch", "num_tokens"), [(1, 1), (3, 1), (2, 8), (1, 40)])
def test_replaces_every_projection_of_a_few_row_step(batch, num_tokens):
    torch.manual_seed(0)
    target = random_llama(tiny_config(), dtype=torch.bfloat16)
    step, manager = _compiled_step(target)
    inputs = chained_step_inputs(
        target.config, batch=batch, num_tokens=num_tokens, dtype=torch.bfloat16
    )
    assert_step_close(step(*inputs), target(*inputs), atol=2e-2, rtol=2e-2)
    assert manager.stats["skinny_mm"] == PROJECTIONS_PER_LAYER * target.config.num_layers


@pytest.mark.parametrize(
    ("dtype", "batch", "num_tokens", "device_types"),
    [
        pytest.param(torch.bfloat16, 5, 13, ("cpu",), id="65-rows"),
        pytest.param(torch.float32, 1, 1, ("cpu",), id="float32"),
        pytest.param(torch.bfloat16, 1, 1, ("cuda",), id="another-device"),
    ],
)
def test_leaves_other_products_alone(dtype, batch, num_tokens, device_types):
    torch.manual_seed(0)
    target = random_llama(tiny_config(num_layers=1), dtype=dtype)
    step, manager = _compiled_step(target, device_types=device_types)
    inputs = chained_step_inputs(target.config, batch=batch, num_tokens=num_tokens, dtype=dtype)
    assert_step_close(step(*inputs), target(*inputs), atol=2e-2, rtol=2e-2)
    assert manager.stats["skinny_mm"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch", [1, 5])
def test_gpu_bf16_decode_step_replaces_and_matches_eager(batch):
    torch.manual_seed(0)
    target = random_llama(tiny_config(hidden_size=256, intermediate_size=704), dtype=torch.bfloat16)
    target = target.cuda()
    step, manager = _compiled_step(target, device_types=("cuda",))
    inputs = chained_step_inputs(
        target.config, batch=batch, num_tokens=1, dtype=torch.bfloat16, device="cuda"
    )
    assert_step_close(step(*inputs), target(*inputs), atol=3e-2, rtol=3e-2)
    assert manager.stats["skinny_mm"] == PROJECTIONS_PER_LAYER * target.config.num_layers
