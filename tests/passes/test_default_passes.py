"""The default pass pipeline on a bf16 target step, on the GPU.

`compile_verify` with no manager runs `default_passes()`; there the few-row products launch
their Triton kernels. One compile per row count checks the whole pipeline at once: the
compiled step equals eager (to bf16 rounding), the SiLU-and-multiply fusion fires once per
layer, and the norm-prologue fusion fires on one-row products only (twice per layer, once in
the first, whose input norm reads the embedding rather than a sum).
"""

from __future__ import annotations

import pytest
import torch

from specrun.runtime.graphs import compile_verify
from tiny_models import assert_step_close, chained_step_inputs, random_llama, tiny_config

# Every compile must really run: cached graphs would skip the passes.
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("uncached_compiles"),
]


@pytest.mark.parametrize("num_tokens", [1, 8])
def test_default_passes_fuse_and_match_eager(num_tokens):
    torch.manual_seed(0)
    target = random_llama(tiny_config(), dtype=torch.bfloat16).cuda()
    step = compile_verify(target)
    inputs = chained_step_inputs(
        target.config, batch=1, num_tokens=num_tokens, dtype=torch.bfloat16, device="cuda"
    )
    assert_step_close(step(*inputs), target(*inputs), atol=2e-2, rtol=2e-2)
    num_layers = target.config.num_layers
    assert step.manager.stats["mm_silu_mul"] == num_layers
    assert step.manager.stats["rms_norm_mm"] == (2 * num_layers - 1 if num_tokens == 1 else 0)
