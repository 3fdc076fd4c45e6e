"""`specrun bench decode`: plain and speculative round latency per batch bucket against the
memory floor, with the shapes of a known model (tools/random_models.py: Llama-3.1-8B,
Llama-3.1-70B, or SmolLM2-135M, the embedded default) and random bf16 weights (the cost of a
forward does not depend on the weights' values).

Every point runs the engine's own decoder: the round of each bucket compiled with Inductor and
specrun's passes (or eager, `compile=False`) and replayed as one CUDA graph. The state is
filled synthetically (every slot at the same committed length, never done) instead of
prefilled, so that timing needs no prompt forward. Per point:

- round latency: the mean of consecutive replays between two CUDA events;
- the draft phase alone (captured by itself) and so the draft/verify split;
- the floor of a plain step: bytes of every weight read once (the input embedding aside) plus
  the committed K/V, over the measured device copy bandwidth, plus the step's collectives
  timed alone; and the same without the K/V (weights and collectives only);
- GPU idle time inside the decoding loop: the host loop of the decoder (submit, read one round
  behind) under the profiler, 1 - busy kernel time / span; and the same for replays back to
  back, whose idle time is the gaps between kernels inside the graph, not the host;
- from the profile of back-to-back replays, the kernels a round launches: how many, their
  summed time, and the costliest by name (what a launch-bound round spends its time on);
  the same for the draft phase's graph alone, which tells the draft's kernels from
  verification's;
- optionally, the prefill of a batch of random prompts through the decoder's public stream
  (the time to the first token once everything is compiled).

With tensor parallelism (`--tp N`, tools/decode_cli.py) every rank builds its own random shard
(`random_target(sharding=...)`) after seeding the same generator, so the replicated weights
and the draft head agree, and runs this same deterministic sequence of rounds (nothing here
decides from a timing); rank 0 reports. The memory floor is then one rank's: its share of the
weights and of the K/V. Each point also records the round's collectives (all-reduces and the
logits' all-gather) from one eager run and times them alone in a CUDA graph
(tools/collectives.py): their count, bytes, time, and share of the round.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import time

import torch

from ..models.eagle import DraftHead
from ..models.llama import Llama
from ..runtime.config import EngineConfig, SamplingParams
from ..runtime.decoder import Decoder
from ..runtime.graphs import CudaGraphRunner, compile_step
from ..runtime.round import SpecState, draft_phase
from ..runtime.round_plan import RoundVariant
from ..runtime.tree import TreeShape
from .collectives import (
    Collective,
    count_collectives,
    record_collectives,
    time_collectives,
)
from .random_models import kv_bytes, weight_bytes
from .round_timing import (
    idle_fraction,
    kernel_table,
    profile_kernels,
    round_timeline,
    time_replays,
)

logger = logging.getLogger(__name__)


def fill_state(
    state: SpecState, *, context: int, vocab_size: int, temperature: float = 0.0
) -> None:
    """Every slot at `context` committed tokens, active, never stopping, greedy or sampling
    at `temperature`."""
    generator = torch.Generator(device=state.root.device).manual_seed(0)
    state.target.lengths.fill_(context)
    state.root.random_(0, vocab_size, generator=generator)
    state.done.fill_(False)
    state.finish.zero_()
    state.num_output.zero_()
    state.max_new.fill_(state.output.shape[1] // 2)
    state.stop_mask.zero_()
    state.sampling.temperature.fill_(temperature)
    if state.draft is not None:
        state.draft.lengths.fill_(context)
        state.pending.tokens.random_(0, vocab_size, generator=generator)
        state.pending.features.normal_(generator=generator)
        state.pending.num_valid.fill_(1)


def bench_bucket(
    target: Llama,
    head: DraftHead | None,
    *,
    bucket: int,
    tree: TreeShape | None,
    context: int,
    num_rounds: int,
    bandwidth: float,
    compile: bool = True,
    profile_rounds: int | None = None,
    collectives: bool = False,
    draft_split: bool = True,
    num_top_kernels: int = 0,
    timeline: bool = False,
    prompt_length: int = 0,
) -> dict:
    """Plain (tree None) or speculative round latency of one bucket, and what it cost.

    compile: rounds compiled with Inductor (else eager), captured in a CUDA graph either way.
    profile_rounds: rounds profiled for the idle time and kernel table (None: `num_rounds`;
        0: no profile), with `num_top_kernels` of the costliest kernels listed, and with
        `timeline` one profiled round's kernels in launch order (`kernel_timeline`).
    collectives: also record the round's collectives and time them alone
        (tools/collectives.py; tensor parallelism: every rank calls this alike).
    draft_split: also time a speculative round's draft phase alone (compiled or eager, and
        captured, on its own: compiled, a second compilation), hence its verify phase.
    prompt_length: also time the prefill of prompts that long (`prefill_ms`).
    Rounds are greedy, a stochastic tree's sampled (temperature 1). On the CPU (tests) the
    rounds run eagerly without graphs, timed on the host clock, and nothing is profiled."""
    depth = 0 if tree is None else tree.depth
    device = target.lm_head.weight.device
    on_cuda = device.type == "cuda"
    config = EngineConfig(
        device=str(device),
        buckets=(bucket,),
        trees={bucket: tree},
        max_seq_len=context + (3 * num_rounds + 8) * (depth + 1),
        compile=compile,
        cuda_graphs=on_cuda,
        policy="fixed",
    )
    head = head if tree is not None else None
    decoder = Decoder(target, head, config)
    state = decoder.state(bucket)
    stochastic = decoder.planner.is_stochastic(bucket)
    refill = functools.partial(
        fill_state, state, context=context, vocab_size=target.config.vocab_size,
        temperature=1.0 if stochastic else 0.0,
    )  # fmt: skip
    refill()
    started = time.perf_counter()
    variant = decoder.planner.variant_for(bucket, [SamplingParams(temperature=float(stochastic))])
    warmup = decoder.prepare(bucket, variant=variant, prefill=False)
    run = decoder.round_runner(bucket, variant=variant)
    run = run if on_cuda else _eager(run)
    point = {
        "bucket": bucket,
        "mode": "plain" if tree is None else "speculative",
        "tree": None if tree is None else [tree.depth, tree.topk, tree.num_nodes],
        "stochastic": stochastic,
        "context": context,
        "execution": "compiled" if compile else "eager",
        "warmup_s": time.perf_counter() - started,
        "graph_pool_mib": warmup.pool_bytes / 2**20,
    }
    refill()
    point["round_ms"] = time_replays(run, num_rounds=num_rounds, device=device) * 1e3
    profile_rounds = num_rounds if profile_rounds is None else profile_rounds
    profile_rounds = profile_rounds if on_cuda else 0
    point |= _profile(
        run, refill, num_rounds=profile_rounds, num_top_kernels=num_top_kernels, timeline=timeline
    )
    point |= _collective_fields(
        decoder, bucket, variant, context=context, enabled=collectives, num_rounds=num_rounds
    )
    point["collectives_share"] = point["collectives_ms"] / point["round_ms"]
    point |= _floor_fields(target, bucket=bucket, context=context, bandwidth=bandwidth)
    if tree is None:
        point["tokens_per_s"] = bucket / point["round_ms"] * 1e3
        point["floor_ms"] = point["memory_floor_ms"] + point["collectives_ms"]
        point["floor_fraction"] = point["floor_ms"] / point["round_ms"]
        point["weight_floor_ms"] = point["weight_read_ms"] + point["collectives_ms"]
        point["weight_floor_fraction"] = point["weight_floor_ms"] / point["round_ms"]
    elif draft_split:
        refill()
        point |= _draft_phase(
            head, state, tree, num_rounds=num_rounds, compile=compile,
            profile_rounds=profile_rounds, num_top_kernels=num_top_kernels,
        )  # fmt: skip
        point["verify_ms"] = point["round_ms"] - point["draft_ms"]
    else:
        point["draft_ms"] = point["verify_ms"] = None
    if prompt_length:
        point["prompt_length"] = prompt_length
        point["prefill_ms"] = prefill_ms(decoder, bucket, prompt_length=prompt_length)
    decoder.close()
    return point


def _profile(run, refill, *, num_rounds: int, num_top_kernels: int, timeline: bool) -> dict:
    """GPU idle time in the host loop and in back-to-back replays over `num_rounds` profiled
    rounds, and the kernel table of the latter (None / empty with 0 rounds); with `timeline`,
    one replayed round's kernels in order (`round_timing.round_timeline`)."""
    if num_rounds == 0:
        return {"gpu_idle": None, "gpu_idle_in_graph": None, "kernels_per_round": None,
                "kernel_us_per_round": None, "top_kernels": []}  # fmt: skip
    point = {}
    refill()
    for key, host_loop in (("gpu_idle", True), ("gpu_idle_in_graph", False)):
        kernels = profile_kernels(run, num_rounds=num_rounds, host_loop=host_loop)
        point[key] = idle_fraction(kernels)
    if timeline:
        point["kernel_timeline"] = round_timeline(kernels, num_rounds=num_rounds)
    return point | kernel_table(kernels, num_rounds=num_rounds, top=num_top_kernels)


def _collective_fields(
    decoder: Decoder,
    bucket: int,
    variant: RoundVariant,
    *,
    context: int,
    enabled: bool,
    num_rounds: int,
) -> dict:
    """The round's collectives (kinds and counts, input MiB) and their time alone in ms (a
    CUDA graph of them, `num_rounds` replays); none when not `enabled`."""
    if not enabled:
        return {"collectives": {}, "collective_mib": 0.0, "collectives_ms": 0.0}
    recorded = round_collectives(decoder, bucket, variant, context=context)
    seconds = time_collectives(recorded, device=decoder.device, num_rounds=num_rounds)
    return {
        "collectives": count_collectives(recorded),
        "collective_mib": sum(c.num_bytes for c in recorded) / 2**20,
        "collectives_ms": seconds * 1e3,
    }


def round_collectives(
    decoder: Decoder, bucket: int, variant: RoundVariant, *, context: int
) -> list[Collective]:
    """The collectives one round of `variant` launches at `bucket`, in order: recorded from
    one eager run of the same round by a decoder of the same target, head and config but
    eager and without graphs, over a state of its own filled like the benchmark's
    (`fill_state` at `context`). With tensor parallelism every rank calls it alike."""
    eager = Decoder(
        decoder.target,
        decoder.head,
        dataclasses.replace(decoder.config, compile=False, cuda_graphs=False),
    )
    try:
        fill_state(
            eager.state(bucket), context=context, vocab_size=decoder.target.config.vocab_size,
            temperature=1.0 if variant.stochastic else 0.0,
        )  # fmt: skip
        return record_collectives(eager.round_runner(bucket, variant=variant))
    finally:
        eager.close()


def _floor_fields(target: Llama, *, bucket: int, context: int, bandwidth: float) -> dict:
    """This rank's bytes a plain step reads (weights, committed K/V, in GB) and the time to
    read them at `bandwidth`: the weights alone and with the K/V, in ms."""
    weights = weight_bytes(target)
    kv = kv_bytes(target, batch=bucket, context=context)
    return {
        "weight_gb": weights / 1e9,
        "kv_gb": kv / 1e9,
        "weight_read_ms": weights / bandwidth * 1e3,
        "memory_floor_ms": (weights + kv) / bandwidth * 1e3,
    }


def prefill_ms(decoder: Decoder, bucket: int, *, prompt_length: int, num_runs: int = 5) -> float:
    """Median milliseconds from submitting `bucket` random prompts of `prompt_length` tokens
    to having their first tokens on the host (the decoder's prefill; one warm-up run first)."""
    vocab_size = decoder.target.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    params = [SamplingParams(max_new_tokens=1)] * bucket
    times = []
    for _ in range(num_runs + 1):
        prompts = torch.randint(0, vocab_size, (bucket, prompt_length), generator=generator)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in decoder.stream(prompts.tolist(), params):
            pass
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:]) * 1e3


def _draft_phase(
    head: DraftHead,
    state: SpecState,
    tree: TreeShape,
    *,
    num_rounds: int,
    compile: bool,
    profile_rounds: int,
    num_top_kernels: int,
) -> dict:
    """The draft phase of a round alone, compiled (or eager) and captured like the round:
    `draft_ms`, and with `num_top_kernels` and `profile_rounds` the kernel table of
    `profile_rounds` replays (`draft_kernels_per_round`, `draft_kernel_us_per_round`,
    `draft_top_kernels`): which of the round's kernels are the draft's. On the CPU: eager
    calls, timed only."""
    step = compile_step(draft_phase, name="draft_phase") if compile else _eager(draft_phase)
    device = state.root.device
    if device.type != "cuda":
        run = functools.partial(step, head, state, tree)
        return {"draft_ms": time_replays(run, num_rounds=num_rounds, device=device) * 1e3}
    runner = CudaGraphRunner(device)
    runner.capture("draft", lambda: step(head, state, tree))
    try:
        replay = functools.partial(runner.replay, "draft")
        fields = {"draft_ms": time_replays(replay, num_rounds=num_rounds) * 1e3}
        if num_top_kernels and profile_rounds:
            kernels = profile_kernels(replay, num_rounds=profile_rounds, host_loop=False)
            table = kernel_table(kernels, num_rounds=profile_rounds, top=num_top_kernels)
            fields |= {f"draft_{key}": value for key, value in table.items()}
        return fields
    finally:
        runner.close()


def _eager(fn):
    """`fn` under inference mode, as a compiled step (and a captured graph's warm-up) runs."""

    @functools.wraps(fn)
    def step(*args, **kwargs):
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return step
