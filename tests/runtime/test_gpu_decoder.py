"""GPU tier: the decoder with compiled rounds captured as CUDA graphs, one per bucket.

Replayed graphs must decode exactly what eager rounds decode (every bucket, many rounds,
ragged and changing lengths, padding slots), greedy output must equal the reference decoder,
seeded sampling must be reproducible, and nothing inside the decoding loop may synchronise
with the host (torch.cuda.set_sync_debug_mode("error")).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specrun.runtime.config import EngineConfig, SamplingParams
from specrun.runtime.decoder import Decoder
from specrun.runtime.reference import reference_generate
from specrun.runtime.round_plan import RoundVariant
from specrun.runtime.stats import DecodeStats
from specrun.runtime.tree import TreeShape
from tiny_models import TargetAsDraft, decode_tokens, random_head, random_llama, tiny_config

pytestmark = pytest.mark.gpu

BUCKETS = (1, 2, 4)
TREES = {1: TreeShape(4, 3, 10), 2: TreeShape(3, 2, 5), 4: None}


def _models(kind: str, *, vocab_size: int = 211):
    config = tiny_config(head_dim=16, vocab_size=vocab_size)
    target = random_llama(config, dtype=torch.float32).cuda()
    head = TargetAsDraft(target) if kind == "self" else random_head(kind, target).cuda()
    return target, head


def _decode(decoder: Decoder, prompts, params) -> list[list[int]]:
    return decode_tokens(decoder, prompts, params)[0]


def _config(**overrides) -> EngineConfig:
    """One tree per bucket unless a test asks for a policy that chooses among a ladder."""
    fields = dict(device="cuda", buckets=BUCKETS, trees=TREES, max_seq_len=160, policy="fixed")
    return EngineConfig(**(fields | overrides))


PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11], [12]]


@pytest.mark.parametrize(("kind", "policy"), [("self", "cost"), ("eagle3", "fixed")])
def test_graphs_decode_what_eager_rounds_decode_in_every_bucket(kind, policy):
    """With the cost policy every bucket captures its whole ladder (each graph and the eager
    decoder may then pick other shapes: greedy output does not depend on them)."""
    target, head = _models(kind)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    graphs = Decoder(target, head, _config(compile=True, cuda_graphs=True, policy=policy))
    eager = Decoder(target, head, _config(compile=False, cuda_graphs=False, policy=policy))
    with torch.inference_mode():
        graphs.warmup()
        for num_prompts in (1, 2, 3, 4):
            prompts = PROMPTS[:num_prompts]
            assert _decode(graphs, prompts, params) == _decode(eager, prompts, params)
            want = reference_generate(target, prompts, params)
            assert _decode(graphs, prompts, params) == [w.token_ids for w in want]
    # Every round of every bucket's shapes (the cost policy's ladder), each captured once.
    assert set(graphs.warmups) == {
        (bucket, variant) for bucket in BUCKETS for variant in graphs.planner.variants(bucket)
    }
    graphs.close()


def test_a_stochastic_bucket_replays_its_greedy_and_sampled_rounds(fresh_seeds):
    """A stochastic bucket captures two rounds. Greedy batches replay the top-k one (its draws
    the argmax, with no noise) and decode the reference; sampling batches (unseeded: seeded
    requests never draft stochastically) replay the sampled one, in which a head equal to the
    target has every draft accepted (all D per round but each request's last)."""
    target, head = _models("self")
    shape = TreeShape(3, 2, 6, stochastic=True)
    config = _config(compile=True, cuda_graphs=True, buckets=(2,), trees={2: shape})
    decoder = Decoder(target, head, config)
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    sampled = dataclasses.replace(greedy, temperature=1.0)
    stats = DecodeStats()
    top_k = RoundVariant(tree=dataclasses.replace(shape, stochastic=False), greedy=True)
    with torch.inference_mode():
        assert set(decoder.warmup()) == {(2, top_k), (2, RoundVariant(tree=shape))}
        want = reference_generate(target, PROMPTS[:2], greedy)
        assert _decode(decoder, PROMPTS[:2], greedy) == [w.token_ids for w in want]
        decode_tokens(decoder, PROMPTS[:2], sampled, stats=stats)
    assert stats.accepted_histogram[shape.depth] >= sum(stats.accepted_histogram) - 2
    assert len(decoder.warmups) == 2
    decoder.close()


def test_no_host_sync_inside_the_decoding_loop_and_seeds_reproduce():
    """Top-p sampling over a 64k vocabulary: the filtered variant of the round compiles (its
    long-row cumsum included), replays without a sync and reproduces under a seed."""
    target, head = _models("self", vocab_size=65536)
    # One bucket: every bucket's graphs are covered by the test above; this one is about the
    # filtered variant and the loop.
    decoder = Decoder(target, head, _config(compile=True, cuda_graphs=True, buckets=(2,)))
    params = SamplingParams(max_new_tokens=30, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)
    with torch.inference_mode():
        decoder.warmup(filtered=True)
        first = _decode(decoder, PROMPTS[:2], params)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            again = _decode(decoder, PROMPTS[:2], params)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        other = _decode(decoder, PROMPTS[:2], dataclasses.replace(params, seed=4))
    assert again == first
    assert other != first
    assert all(len(tokens) == 30 for tokens in first)


def test_prefill_graphs_per_padded_length_decode_what_eager_prefills_decode():
    """Prefills replay graphs captured per (bucket, padded length) up to prefill_graph_tokens
    and run the compiled forwards past it; both decode what eager decoding does."""
    target, head = _models("eagle3")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    graphs = Decoder(target, head, _config(compile=True, cuda_graphs=True, prefill_graph_tokens=64))
    eager = Decoder(target, head, _config(compile=False, cuda_graphs=False))
    batches = [[[3] * 5], [[4] * 20], [[5] * 40], [[6] * 70], [[7] * 20, [8] * 3], [[9] * 20] * 3]
    with torch.inference_mode():
        graphs.warmup(prompt_lengths=[20])  # 16 tokens (every bucket's warm-up) and 24
        assert graphs.prefill_graphs == [(1, 16), (1, 24), (2, 16), (2, 24), (4, 16)]
        for prompts in batches:
            prompts = [
                [(t + 13 * j) % 200 + 1 for j in range(len(p))] for t, p in enumerate(prompts)
            ]
            assert _decode(graphs, prompts, params) == _decode(eager, prompts, params)
    # 70 tokens pad to 96 (> 64 tokens: compiled forwards); 3 x 20 pads to 4 x 24 (96 > 64).
    assert graphs.prefill_graphs == [(1, 16), (1, 24), (1, 48), (2, 16), (2, 24), (4, 16)]
    graphs.close()


def test_a_seeded_request_that_captures_a_prefill_graph_reproduces():
    """Capturing (its warm-up runs sample) leaves the seeded RNG alone. Called with autograd
    on, as users call it: capturing runs the head's eager code in inference mode."""
    target, head = _models("eagle3")
    decoder = Decoder(target, head, _config(compile=True, cuda_graphs=True, buckets=(1,)))
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=5, ignore_eos=True)
    prompts = [list(range(1, 31))]
    decoder.warmup()
    assert decoder.prefill_graphs == [(1, 16)]
    first = _decode(decoder, prompts, params)
    assert decoder.prefill_graphs == [(1, 16), (1, 32)]
    again = _decode(decoder, prompts, params)
    assert again == first
    decoder.close()
