"""Compiled prefills compile once per batch kind, whatever the bucket and the prompt lengths.

The prefill forwards are compiled with dynamic shapes. Some inputs would make Dynamo
recompile for every bucket and many prompt lengths: a bucket's KV view of the shared store
(its layer stride depends on the largest bucket), duck-sized batch and length dims that get
specialised with the model dims they happen to equal, lengths of 1 (0/1 specialisation) and
bitmasks of one word. prefill.py feeds both forwards fresh, explicitly dynamic inputs instead, so
a prefill compiles one graph for batch 1 and one for every larger batch, and decoding from
compiled prefills reproduces eager decoding token for token (float64: greedy decoding is
exact). Rounds run eagerly here: compiling them would triple the test's time, and compiled
rounds are covered elsewhere (tests/graphs, the GPU tier).
"""

from __future__ import annotations

import torch

from specrun.runtime.config import EngineConfig, SamplingParams
from specrun.runtime.decoder import Decoder
from specrun.runtime.round import decode_round, speculative_round
from specrun.runtime.tree import TreeShape
from tiny_models import TargetAsDraft, decode_tokens, random_llama, tiny_config

# Batch 1 (size 1 is always specialised) and every larger batch.
MAX_PREFILL_GRAPHS = 2
# Every prompt length class: 1 and 2 (a target or draft length of 1 before padding), short,
# and past 64 and 128 tokens (2 and 3 bitmask words).
LENGTHS = (1, 2, 5, 9, 70, 130)


def _decoder(target, *, compile: bool) -> Decoder:
    config = EngineConfig(
        device="cpu",
        buckets=(1, 2, 4),
        trees={1: TreeShape(3, 2, 4), 2: TreeShape(2, 2, 3), 4: None},
        compile=compile,
        cuda_graphs=False,
        max_seq_len=160,
        policy="fixed",
    )
    decoder = Decoder(target, TargetAsDraft(target), config, eos_token_ids=(11,))
    decoder._round, decoder._decode = speculative_round, decode_round  # prefills compiled only
    return decoder


def _decode(decoder: Decoder, prompts, params) -> list[list[int]]:
    return decode_tokens(decoder, prompts, params)[0]


def _prompts(num_prompts: int, first: int) -> list[list[int]]:
    """Ragged prompts: lengths cycle through LENGTHS starting at index `first`."""
    lengths = [LENGTHS[(first + i) % len(LENGTHS)] for i in range(num_prompts)]
    return [[(7 * slot + 3 * j) % 200 + 1 for j in range(n)] for slot, n in enumerate(lengths)]


def test_prefill_compiles_once_per_batch_kind_and_decodes_like_eager(uncached_compiles):
    torch.manual_seed(0)
    target = random_llama(tiny_config(head_dim=16, vocab_size=211), dtype=torch.float64)
    compiled, eager = _decoder(target, compile=True), _decoder(target, compile=False)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with torch.inference_mode():
        compiled.warmup()  # every bucket's prefill (2-token prompts), largest bucket first
        for first in range(len(LENGTHS)):
            for num_prompts in (1, 2, 3, 4):  # buckets 1, 2, 4 (3 pads to 4)
                prompts = _prompts(num_prompts, first)
                want = _decode(eager, prompts, params)
                assert _decode(compiled, prompts, params) == want, (first, num_prompts)
    steps = {"target": compiled._prefill_target, "draft": compiled._prefill_draft}
    counts = {name: step.num_compiles for name, step in steps.items()}
    assert counts == {"target": MAX_PREFILL_GRAPHS, "draft": MAX_PREFILL_GRAPHS}
    # Every compiled graph still fuses each layer's attention into rt::tree_attention.
    num_layers = target.config.num_layers
    for step in steps.values():
        assert step.manager.stats["tree_attention"] == num_layers * step.num_compiles
