"""Continuous batching's mechanism: requests admitted into free slots of a running bucket, at
different rounds and into slots freed by finished requests, decode exactly what each decodes
alone with the reference decoder (greedy, and seeded sampling with a top-k tree), and the
slots already decoding are not disturbed."""

from __future__ import annotations

import pytest
import torch

from specrun.runtime.config import SamplingParams
from specrun.runtime.prefill import allocate_state
from specrun.runtime.reference import reference_generate
from specrun.runtime.round import ReportColumns, decode_round, speculative_round
from specrun.runtime.slots import admit
from specrun.runtime.tree import TreeShape
from tiny_models import TargetAsDraft, random_head, random_llama, tiny_config

# Request i: (prompt, params). Short and long answers, greedy and sampled.
REQUESTS = [
    ([1, 2, 3], SamplingParams(max_new_tokens=9)),
    ([4, 5], SamplingParams(max_new_tokens=14, temperature=1.0, seed=21)),
    ([6, 7, 8, 9, 10], SamplingParams(max_new_tokens=5, temperature=0.8, top_p=0.9, seed=5)),
    ([11], SamplingParams(max_new_tokens=12)),
    ([12, 13, 14], SamplingParams(max_new_tokens=7, temperature=1.2, seed=2**40 + 3)),
    ([15, 16], SamplingParams(max_new_tokens=10)),
]
# The round each request arrives at; it is admitted into the lowest free slot then, or as
# soon as a finished request frees one (FIFO), so later requests reuse freed slots.
ARRIVALS = [0, 0, 1, 2, 2, 3]


def _decode_with_admissions(target, head, shape):
    state = allocate_state(
        target, head, batch_size=4, capacity=64, depth=0 if shape is None else shape.depth
    )
    tokens: dict[int, list[int]] = {}
    slot_request: dict[int, int] = {}

    def collect(report, slots):
        for slot, row in zip(slots, report.tolist(), strict=True):
            if slot in slot_request:
                num = row[ReportColumns.NUM_EMITTED]
                new = row[ReportColumns.TOKENS : ReportColumns.TOKENS + num]
                tokens[slot_request[slot]] += new
                if row[ReportColumns.DONE]:
                    del slot_request[slot]

    waiting: list[int] = []
    used: set[int] = set()
    num_reused = 0
    for round_index in range(60):
        waiting += [i for i, when in enumerate(ARRIVALS) if when == round_index]
        free = [slot for slot in range(4) if slot not in slot_request]
        while waiting and free:
            request, slot = waiting.pop(0), free.pop(0)
            num_reused += slot in used
            used.add(slot)
            prompt, params = REQUESTS[request]
            slot_request[slot], tokens[request] = request, []
            report = admit(target, head, state, [slot], [prompt], [params], eos_token_ids=())
            collect(report, [slot])
        if len(tokens) == len(REQUESTS) and not slot_request:
            break
        if shape is None:
            report = decode_round(target, state)
        else:
            report = speculative_round(target, head, state, shape)
        collect(report, range(4))
    assert num_reused == 2  # requests 4 and 5 went into slots that finished requests freed
    return [tokens[i] for i in range(len(REQUESTS))]


@pytest.mark.parametrize("kind", ["perfect", "eagle3", "plain"])
def test_admitted_requests_decode_what_each_decodes_alone(kind):
    target = random_llama(tiny_config(), dtype=torch.float64)
    head, shape = None, None
    if kind != "plain":
        head = TargetAsDraft(target) if kind == "perfect" else random_head(kind, target)
        shape = TreeShape(3, 2, 6)
    with torch.no_grad():
        got = _decode_with_admissions(target, head, shape)
        want = [
            reference_generate(target, [prompt], params)[0].token_ids for prompt, params in REQUESTS
        ]
    assert got == want
    assert [len(t) for t in got] == [p.max_new_tokens for _, p in REQUESTS]
