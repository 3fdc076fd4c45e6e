"""GPU tier: speculative greedy decoding in bf16 equals reference greedy decoding, up to
divergences at near-ties of the target's top two logits (each one reported)."""

from __future__ import annotations

import pytest
import torch

from specrun.runtime.config import SamplingParams
from specrun.runtime.reference import reference_generate
from specrun.runtime.speculative import speculative_generate
from specrun.runtime.tree import TreeShape
from tiny_models import TargetAsDraft, prompt_logits, random_head, random_llama, tiny_config

pytestmark = pytest.mark.gpu

# bf16 logits carry about 3 significant digits: a gap below this is a tie to the model.
NEAR_TIE = 0.05


def _top2_gap(target, tokens: list[int]) -> float:
    """Gap between the target's two best next-token logits after `tokens` (fresh forward)."""
    top = prompt_logits(target, tokens)[-1].float().topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "perfect"])
def test_bf16_speculative_equals_reference_up_to_near_ties(kind):
    config = tiny_config(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
    )
    target = random_llama(config, seed=3, dtype=torch.bfloat16).cuda()
    head = TargetAsDraft(target) if kind == "perfect" else random_head(kind, target).cuda()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (5, 17, 33, 64)]
    params = SamplingParams(max_new_tokens=48)
    with torch.no_grad():
        want = reference_generate(target, prompts, params)
        got, stats = speculative_generate(target, head, prompts, params, shape=TreeShape(5, 4, 24))
        divergences = []
        for prompt, w, g in zip(prompts, want, got, strict=True):
            if w.token_ids == g.token_ids:
                continue
            i = next(
                i for i, (a, b) in enumerate(zip(w.token_ids, g.token_ids, strict=False)) if a != b
            )
            divergences.append((i, _top2_gap(target, prompt + w.token_ids[:i])))
    print(
        f"{kind}: mean accepted length {stats.mean_accepted_length:.2f}, divergences "
        f"(position, top-2 logit gap): {divergences}"
    )
    assert all(gap < NEAR_TIE for _, gap in divergences), divergences
