"""GPU tier: continuous batching over captured graphs. Requests joining and leaving across
bucket boundaries (1 -> 2 -> 4 -> 2 -> 1), one of them prefilled in chunks, while the round's
shape changes between rounds, after the warm-up cause no compilation and no new capture,
nothing in the loop synchronises with the host, and every request decodes what the reference
decoder decodes for it alone (greedy, and seeded sampling)."""

from __future__ import annotations

import pytest
import torch

from specrun.runtime.config import EngineConfig, SamplingParams
from specrun.runtime.decoder import Decoder
from specrun.runtime.reference import reference_generate
from specrun.runtime.scheduler import Scheduler
from specrun.runtime.tree import TreeShape
from tiny_models import ShuffledPolicy, random_head, random_llama, tiny_config

pytestmark = pytest.mark.gpu

TREES = {1: TreeShape(4, 3, 10), 2: TreeShape(3, 2, 6), 4: TreeShape(2, 2, 4)}
# (prompt, max_new_tokens, sampled, arrival pass): the batch grows to 4 slots and shrinks.
REQUESTS = [
    ([5, 6, 7], 30, False, 0),
    ([1, 2], 12, True, 2),
    ([9] * 11, 40, False, 4),
    ([3, 4, 5, 6], 8, True, 4),
    ([12, 13], 25, True, 9),
    ([7] * 15, 6, False, 30),
    # Longer than the prefill budget: prefilled in three chunks while the others decode.
    ([11] * 20 + [4] * 20, 10, True, 6),
]


def _params(max_new: int, sampled: bool, index: int) -> SamplingParams:
    if sampled:
        return SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=index, ignore_eos=True)
    return SamplingParams(max_new_tokens=max_new, ignore_eos=True)


def test_requests_across_bucket_boundaries_need_no_compile_or_capture():
    """The policy changes the shape every round (plain decoding included): a random choice
    among the ladder, so every captured round runs."""
    target = random_llama(tiny_config(head_dim=16, vocab_size=211), dtype=torch.float32).cuda()
    head = random_head("eagle3", target).cuda()
    config = EngineConfig(device="cuda", buckets=(1, 2, 4), trees=TREES, max_seq_len=128)
    decoder = Decoder(target, head, config)
    decoder.planner.policy = ShuffledPolicy(seed=0)
    scheduler = Scheduler(
        decoder, tokenizer=None, max_waiting=16, max_prefill_tokens=16, threaded=False
    )
    with torch.inference_mode():
        decoder.warmup(prompt_lengths=[16])
    num_compiles = {name: s.num_compiles for name, s in decoder.compiled_steps().items()}
    num_graphs = len(decoder._runner.graphs)
    handles = {}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(500):
            for index, (prompt, max_new, sampled, arrival) in enumerate(REQUESTS):
                if arrival == step:
                    handles[index] = scheduler.submit(prompt, _params(max_new, sampled, index))
            if not scheduler.step() and len(handles) == len(REQUESTS):
                break
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert {name: s.num_compiles for name, s in decoder.compiled_steps().items()} == num_compiles
    assert len(decoder._runner.graphs) == num_graphs
    assert {key.split(":")[0] for key in scheduler.stats().rounds_by_bucket} >= {"1", "2", "4"}
    with torch.inference_mode():
        for index, (prompt, max_new, sampled, _) in enumerate(REQUESTS):
            [want] = reference_generate(target, [prompt], _params(max_new, sampled, index))
            assert handles[index].result(timeout=0).token_ids == want.token_ids, index
    assert scheduler.slots == [None] * 4
    decoder.close()
