"""oneDNN-packed Linears for eager CPU decoding.

A PackedLinear must compute what its Linear computes (float32 to its accumulation order,
bfloat16 to one rounding of the output), for 2-D, 3-D and strided inputs, with and without
bias, and give a FusedLinear's parts as FusedLinear does; `pack_target_and_head` must leave
no Linear unpacked, keep the dense weight only where it is read (the tied LM head), point the
head at the packed target modules, and decode what the unpacked models decode, greedy and
speculative.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specrun.models.fused_linear import FusedLinear
from specrun.models.packed_linear import (
    PackedLinear,
    pack_linears,
    pack_target_and_head,
    packs_linears,
)
from specrun.runtime.config import SamplingParams
from specrun.runtime.reference import reference_generate
from specrun.runtime.speculative import speculative_generate
from specrun.runtime.tree import TreeShape
from tiny_models import random_head, random_llama, tiny_config

pytestmark = pytest.mark.skipif(
    not packs_linears(torch.device("cpu"), torch.float32), reason="needs torch with oneDNN"
)

TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _inputs(shape: str, k: int, dtype: torch.dtype) -> torch.Tensor:
    if shape == "rows":
        return torch.randn(5, k, dtype=dtype)
    if shape == "batch":
        return torch.randn(2, 3, k, dtype=dtype)
    return torch.randn(2, k, 7, dtype=dtype).transpose(1, 2)  # strided


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", ["rows", "batch", "strided"])
def test_packed_linear_computes_its_linear(dtype, bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(19, 37, bias=bias).to(dtype)
    x = _inputs(shape, 19, dtype)
    want = F.linear(x.float(), linear.weight.float(), linear.bias.float() if bias else None)
    got = PackedLinear(linear)(x)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **TOLERANCES[dtype])


def test_a_packed_fused_linear_gives_its_parts():
    torch.manual_seed(0)
    fused = FusedLinear(11, {"q_proj": 6, "k_proj": 3, "v_proj": 3}, bias=True)
    packed = PackedLinear(fused)
    x = torch.randn(2, 4, 11)
    for got, want in zip(packed(x), fused(x), strict=True):
        torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])
    torch.testing.assert_close(packed.joint(x), fused.joint(x), **TOLERANCES[torch.float32])


def test_packing_drops_the_dense_weights_but_those_kept():
    model = nn.Sequential(nn.Linear(4, 5), nn.Sequential(nn.Linear(5, 6, bias=False)))
    kept = model[1][0].weight
    assert pack_linears(model, keep_weight=("1.0",)) == 2
    assert not hasattr(model[0], "weight") and model[1][0].weight is kept
    assert not any(type(m) is nn.Linear for m in model.modules())


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_target_and_head_packed_decode_what_they_decoded(kind):
    target = random_llama(tiny_config(tie_word_embeddings=True), seed=3)
    head = random_head(kind, target, seed=4)
    unpacked_target = copy.deepcopy(target)
    num_layers = target.config.num_layers
    num_head_linears = sum(isinstance(m, nn.Linear) for m in head.modules())

    assert pack_target_and_head(target, head) == 4 * num_layers + 1 + num_head_linears
    assert not any(isinstance(m, nn.Linear) for m in [*target.modules(), *head.modules()])
    assert target.lm_head.weight is target.embed_tokens.weight
    assert head.shared.lm_head is target.lm_head and head.shared.embed_tokens is target.embed_tokens

    prompts = [[5, 17, 33, 2], [9, 1]]
    params = [SamplingParams(max_new_tokens=12, temperature=0.0)] * len(prompts)
    want = reference_generate(unpacked_target, prompts, params)
    assert [o.token_ids for o in reference_generate(target, prompts, params)] == [
        o.token_ids for o in want
    ]
    got, _ = speculative_generate(target, head, prompts, params, shape=TreeShape(3, 2, 6))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
