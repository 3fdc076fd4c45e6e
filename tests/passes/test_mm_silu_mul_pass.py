"""The SiLU-and-multiply fusion: a SwiGLU MLP's gate/up product and its SiLU(gate) * up become
one `rt::mm_silu_mul`.

It fires once per layer of a few-row target forward (the step, a verification) and the
compiled forward equals eager (to bf16 rounding); it leaves alone products the skinny-mm pass
did not make. The tests build the skinny-mm pass for "cpu" (the ops run their references
there); `test_default_passes.py` runs the fusion on the GPU, where the op launches its Triton
kernel.
"""

from __future__ import annotations

import pytest
import torch

from specrun.runtime.graphs import compile_verify
from specrun.runtime.passes import PassManager
from specrun.runtime.passes.mm_silu_mul import SiluMulFusion
from specrun.runtime.passes.skinny_mm import SkinnyMMReplacement
from tiny_models import assert_step_close, chained_step_inputs, random_llama, tiny_config

# Every compile must really run: cached graphs would skip the passes.
pytestmark = pytest.mark.usefixtures("uncached_compiles")


def _compiled_step(target, *, device_types=("cpu",)):
    manager = PassManager([SkinnyMMReplacement(device_types=device_types), SiluMulFusion()])
    return compile_verify(target, manager=manager), manager


@pytest.mark.parametrize(("batch", "num_tokens"), [(1, 1), (2, 8)])
def test_fuses_every_layer_and_matches_eager(batch, num_tokens):
    torch.manual_seed(0)
    target = random_llama(tiny_config(), dtype=torch.bfloat16)
    step, manager = _compiled_step(target)
    inputs = chained_step_inputs(
        target.config, batch=batch, num_tokens=num_tokens, dtype=torch.bfloat16
    )
    assert_step_close(step(*inputs), target(*inputs), atol=2e-2, rtol=2e-2)
    assert manager.stats["mm_silu_mul"] == target.config.num_layers


def test_leaves_products_without_rt_skinny_mm_alone():
    torch.manual_seed(0)
    target = random_llama(tiny_config(num_layers=1), dtype=torch.bfloat16)
    step, manager = _compiled_step(target, device_types=("cuda",))
    inputs = chained_step_inputs(target.config, batch=1, num_tokens=1, dtype=torch.bfloat16)
    assert_step_close(step(*inputs), target(*inputs), atol=2e-2, rtol=2e-2)
    assert manager.stats["mm_silu_mul"] == 0
