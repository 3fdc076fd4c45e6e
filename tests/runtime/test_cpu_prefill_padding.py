"""CPU prefills pad to a bounded set of shapes (runtime/prefill.py, `pads_prefills`).

Through the scheduler, prompts of many distinct lengths (batch prefills into an idle decoder,
admissions into running batches, prompts longer than the budget prefilled in chunks) run
every forward, target and draft, over a bucket's batch and one of `prefill_length`'s lengths,
or over a round's few tokens: the row counts a process multiplies do not grow with the
prompts it sees (oneDNN keeps memory for each). And every request decodes token for token
what the reference decoder, which prefills its prompt unpadded, decodes for it alone.
"""

from __future__ import annotations

import pytest
import torch

from specrun.runtime.config import EngineConfig, SamplingParams
from specrun.runtime.decoder import Decoder
from specrun.runtime.prefill import pads_prefills, prefill_length
from specrun.runtime.reference import reference_generate
from specrun.runtime.scheduler import Scheduler
from specrun.runtime.tree import TreeShape
from tiny_models import targets_with_heads

TREES = {1: TreeShape(3, 2, 6), 2: TreeShape(2, 3, 5), 4: TreeShape(1, 2, 3)}
CONFIG = EngineConfig(device="cpu", buckets=(1, 2, 4), trees=TREES, max_seq_len=80, compile=False)
# Prompts longer than this (33 to 40 tokens) are prefilled in chunks of at most this many.
MAX_PREFILL_TOKENS = 32
# The padded lengths of prefills (whole prompts and chunks) of at most MAX_PREFILL_TOKENS;
# rounds run fewer tokens than the shortest.
LADDER = {prefill_length(n) for n in range(1, MAX_PREFILL_TOKENS + 1)}
# 40 prompts of distinct lengths 1..40, mixed so that short and long ones share batches.
LENGTHS = [(17 * i) % 40 + 1 for i in range(40)]


@pytest.fixture(scope="module")
def models():
    return targets_with_heads()


def _params(index: int) -> SamplingParams:
    if index % 3:
        return SamplingParams(max_new_tokens=6)
    return SamplingParams(max_new_tokens=6, temperature=1.0, top_k=8, seed=index)


def _forward_shapes(*modules) -> tuple[list[tuple[int, int]], list]:
    """The [B, T] shape of the tokens of every forward of `modules`, and the hooks."""
    shapes: list[tuple[int, int]] = []

    def record(module, args):
        shapes.append(tuple(args[0].shape))

    return shapes, [m.register_forward_pre_hook(record) for m in modules if m is not None]


def test_prefills_pad_on_the_cpu_only():
    assert pads_prefills(torch.device("cpu"))
    assert not pads_prefills(torch.device("cuda", 0))
    assert sorted(LADDER) == [16, 24, 32]


@pytest.mark.parametrize("kind", ["plain", "eagle3"])
def test_prefills_run_a_few_shapes_and_decode_what_the_reference_decodes(models, kind):
    target, head = models[kind]
    scheduler = Scheduler(
        Decoder(target, head, CONFIG),
        tokenizer=None,
        max_waiting=64,
        max_prefill_tokens=MAX_PREFILL_TOKENS,
        threaded=False,
    )
    prompts = [[(5 * i + 3 * j) % 96 + 1 for j in range(n)] for i, n in enumerate(LENGTHS)]
    shapes, hooks = _forward_shapes(target, head)
    handles = []
    try:
        with torch.no_grad():
            for start in range(0, len(prompts), 3):  # three arrive every pass
                for index in range(start, min(start + 3, len(prompts))):
                    handles.append(scheduler.submit(prompts[index], _params(index)))
                scheduler.step()
            while scheduler.step():
                pass
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        for index, (prompt, handle) in enumerate(zip(prompts, handles, strict=True)):
            [want] = reference_generate(target, [prompt], _params(index))
            got = handle.result(timeout=0)
            assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    smallest = min(LADDER)
    prefills = {shape for shape in shapes if shape[1] >= smallest}
    rounds = {shape for shape in shapes if shape[1] < smallest}
    assert prefills <= {(b, n) for b in CONFIG.buckets for n in LADDER}, sorted(prefills)
    assert {n for _, n in prefills} == LADDER  # batch prefills, admissions and chunks ran
    assert rounds and all(b in CONFIG.buckets for b, _ in rounds), sorted(rounds)
    assert scheduler.stats().num_requests == len(prompts)
