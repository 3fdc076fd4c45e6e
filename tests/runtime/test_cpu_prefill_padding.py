"""CPU prefills are shaped for a bounded set of row counts (runtime/slots.py,
`max_prefill_rows`, `prefill_plan`).

`prefill_plan` splits a batch into groups of a power of two of consecutive slots, each padded
to `prefill_length` of its longest prompt, at most `max_rows` rows a forward. Through the
scheduler, prompts of many distinct lengths (batch prefills into an idle decoder, admissions
into running batches, prompts longer than the budget prefilled in chunks) run every forward,
target and draft, over such a group or over a round's few tokens, so the row counts a process
multiplies do not grow with the prompts it sees (oneDNN keeps memory for each); and every
request decodes token for token what the reference decoder, which prefills its prompt
unpadded and whole, decodes for it alone.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrun.runtime import slots as slots_module
from specrun.runtime.config import EngineConfig, SamplingParams
from specrun.runtime.decoder import Decoder
from specrun.runtime.prefill import prefill_length
from specrun.runtime.reference import reference_generate
from specrun.runtime.scheduler import Scheduler
from specrun.runtime.slots import max_prefill_rows, prefill_plan
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


def test_prefills_are_shaped_on_the_cpu_only():
    assert max_prefill_rows(torch.device("cpu")) == slots_module.CPU_PREFILL_ROWS
    assert prefill_length(slots_module.CPU_PREFILL_ROWS) == slots_module.CPU_PREFILL_ROWS
    assert max_prefill_rows(torch.device("cuda", 0)) is None
    assert sorted(LADDER) == [16, 24, 32]


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=70),
    max_rows=st.sampled_from([16, 64, 96, 512]),
    capacity=st.integers(300, 2048),
)
def test_the_plan_covers_every_slot_in_padded_power_of_two_groups(lengths, max_rows, capacity):
    plan = prefill_plan(lengths, max_rows=max_rows, capacity=capacity)
    firsts = [first for first, _, _ in plan]
    assert firsts == [0, *itertools.accumulate(size for _, size, _ in plan[:-1])]
    assert sum(size for _, size, _ in plan) == len(lengths)
    for first, size, length in plan:
        group = lengths[first : first + size]
        assert size & (size - 1) == 0
        assert length == prefill_length(max(group), max_length=capacity) >= max(group)
        assert size * length <= max_rows or size == 1
        # A group doubles while the doubled group still fits.
        if first + 2 * size <= len(lengths):
            doubled = lengths[first : first + 2 * size]
            longer = prefill_length(max(doubled), max_length=capacity)
            assert 2 * size * longer > max_rows


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


def _decode_all(scheduler: Scheduler, prompts: list[list[int]]) -> list:
    handles = []
    with torch.no_grad():
        for start in range(0, len(prompts), 3):  # three arrive every pass
            for index in range(start, min(start + 3, len(prompts))):
                handles.append(scheduler.submit(prompts[index], _params(index)))
            scheduler.step()
        while scheduler.step():
            pass
    return handles


@pytest.mark.parametrize("max_rows", [32, 512])
@pytest.mark.parametrize("kind", ["plain", "eagle3"])
def test_prefills_run_a_few_shapes_and_decode_what_the_reference_decodes(
    models, kind, max_rows, monkeypatch
):
    """max_rows 32 splits batches into groups and chunks into pieces; 512 runs them whole."""
    monkeypatch.setattr(slots_module, "CPU_PREFILL_ROWS", max_rows)
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
    try:
        handles = _decode_all(scheduler, prompts)
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
    assert {n for _, n in prefills} == LADDER, sorted(prefills)
    assert all(b * n <= max_rows and b in CONFIG.buckets for b, n in prefills), sorted(prefills)
    assert rounds and all(b in CONFIG.buckets for b, _ in rounds), sorted(rounds)
    assert scheduler.stats().num_requests == len(prompts)
