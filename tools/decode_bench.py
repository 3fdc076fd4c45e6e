"""`specrun bench decode`: plain and speculative round latency per batch bucket against the
memory floor, with the shapes of a known model (Llama-3.1-8B, or SmolLM2-135M, the embedded
default) and random bf16 weights (the cost of a forward does not depend on the weights' values).

Every point runs the engine's own decoder: the round of each bucket compiled with Inductor and
specrun's passes and replayed as one CUDA graph. The state is filled synthetically (every slot
at the same committed length, never done) instead of prefilled, so that timing needs no
prompt forward. Per point:

- round latency: the mean of consecutive replays between two CUDA events;
- the draft phase alone (captured by itself) and so the draft/verify split;
- the floor of a plain step: bytes of every weight read once (the input embedding aside) plus
  the committed K/V, over the measured device copy bandwidth;
- GPU idle time inside the decoding loop: the host loop of the decoder (submit, read one round
  behind) under the profiler, 1 - busy kernel time / span; and the same for replays back to
  back, whose idle time is the gaps between kernels inside the graph, not the host;
- from the profile of back-to-back replays, the kernels a round launches: how many, their
  summed time, and the costliest by name (what a launch-bound round spends its time on);
- optionally, the prefill of a batch of random prompts through the decoder's public stream
  (the time to the first token once everything is compiled).

With tensor parallelism (`--tp N`, tools/bench.py) every rank builds its own random shard
(`random_target(sharding=...)`) after seeding the same generator, so the replicated weights
and the draft head agree, and runs this same deterministic sequence of rounds (nothing here
decides from a timing); rank 0 reports. The memory floor is then one rank's: its share of the
weights and of the K/V.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..models.config import DraftConfig, LlamaConfig
from ..models.eagle import DraftHead, build_draft
from ..models.llama import Llama
from ..models.tensor_parallel import Sharding, build_sharded_llama
from ..runtime.config import EngineConfig, SamplingParams
from ..runtime.decoder import Decoder
from ..runtime.graphs import CudaGraphRunner, compile_step
from ..runtime.reports import ReportReader
from ..runtime.round import SpecState, draft_phase
from ..runtime.tree import TreeShape

logger = logging.getLogger(__name__)

LLAMA_31_8B = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    max_position_embeddings=131072,
)

SMOLLM2_135M = LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


@dataclass(frozen=True)
class BenchShapes:
    """A target's shapes and the draft vocabulary of its EAGLE-3 head."""

    description: str
    target: LlamaConfig
    draft_vocab_size: int


SHAPES = {
    "llama-3.1-8b": BenchShapes("Llama-3.1-8B shapes", LLAMA_31_8B, 32000),
    "smollm2-135m": BenchShapes("SmolLM2-135M shapes", SMOLLM2_135M, 8192),
}


def random_target(
    config: LlamaConfig,
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    sharding: Sharding | None = None,
) -> Llama:
    """A Llama of `config`'s shapes with small random weights, built directly on `device`;
    with `sharding`, only that rank's tensor-parallel shard (models/tensor_parallel.py)."""
    with torch.device("meta"):
        model = Llama(config) if sharding is None else build_sharded_llama(config, sharding)
    model.to_empty(device=device)
    _randomize(model, dtype)
    model.rotary.init_buffers(device)
    model.tie_weights()
    return model.eval()


def random_eagle3_head(target: Llama, *, draft_vocab_size: int, dtype: torch.dtype) -> DraftHead:
    """An EAGLE-3 head (1 layer, `draft_vocab_size` outputs) with random weights."""
    config = DraftConfig(
        kind="eagle3",
        layer=target.config,
        target_hidden_size=target.config.hidden_size,
        draft_vocab_size=draft_vocab_size,
        tap_layers=target.tap_layers,
    )
    device = target.lm_head.weight.device
    with torch.device("meta"):
        head = build_draft(config, target)
    head.to_empty(device=device)
    _randomize(head, dtype)
    head.d2t.zero_()
    head.t2d.copy_(torch.arange(target.config.vocab_size, device=device) < draft_vocab_size)
    head.init_buffers(device)
    return head.eval()


def _randomize(module: torch.nn.Module, dtype: torch.dtype) -> None:
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.data = param.data.to(dtype)
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)


def floor_seconds(target: Llama, *, batch: int, context: int, bandwidth: float) -> float:
    """A plain step's memory floor: weights (the embedding table aside) + committed K/V."""
    config = target.config
    weights = sum(
        p.numel() * p.element_size()
        for name, p in target.named_parameters()
        if not name.startswith("embed_tokens")
    )
    if config.tie_word_embeddings:
        weights += target.lm_head.weight.numel() * target.lm_head.weight.element_size()
    element = target.lm_head.weight.element_size()
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * element
    return (weights + batch * context * kv) / bandwidth


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


def time_replays(run, *, num_rounds: int) -> float:
    """Mean seconds of `run` over `num_rounds` back-to-back launches (GPU time)."""
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(num_rounds):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / num_rounds


@dataclass(frozen=True)
class KernelSpan:
    """One kernel execution seen by the profiler: name, start and end in microseconds."""

    name: str
    start: float
    end: float


def profile_kernels(run, *, bucket: int, num_rounds: int, host_loop: bool) -> list[KernelSpan]:
    """The kernels of `num_rounds` rounds, driven by the decoder's host loop (launch, copy the
    report out, read it one round behind) when `host_loop`, else replayed back to back."""
    from torch.profiler import ProfilerActivity, profile

    reader = ReportReader(torch.device("cuda"))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(num_rounds):
            if not host_loop:
                run()
                continue
            while len(reader) <= 1:
                reader.submit(run)
            reader.read()
        torch.cuda.synchronize()
    return sorted(
        (
            KernelSpan(e.name, e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0
        ),
        key=lambda k: (k.start, k.end),
    )


def idle_fraction(kernels: list[KernelSpan]) -> float | None:
    """1 - (union of kernel intervals) / span; None without kernels."""
    if not kernels:
        return None
    busy, current_start, current_end = 0.0, kernels[0].start, kernels[0].end
    for kernel in kernels[1:]:
        if kernel.start > current_end:
            busy += current_end - current_start
            current_start, current_end = kernel.start, kernel.end
        else:
            current_end = max(current_end, kernel.end)
    busy += current_end - current_start
    span = kernels[-1].end - kernels[0].start
    return max(0.0, 1.0 - busy / span) if span > 0 else None


def kernel_table(kernels: list[KernelSpan], *, num_rounds: int, top: int) -> dict:
    """Per round: kernels launched, their summed time (us), and the `top` costliest kernel
    names as [name, launches per round, us per round]."""
    count: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    for kernel in kernels:
        count[kernel.name] += 1
        total[kernel.name] += kernel.end - kernel.start
    costliest = sorted(total, key=total.get, reverse=True)[:top]
    return {
        "kernels_per_round": len(kernels) / num_rounds,
        "kernel_us_per_round": sum(total.values()) / num_rounds,
        "top_kernels": [
            [name[:120], count[name] / num_rounds, total[name] / num_rounds] for name in costliest
        ],
    }


def bench_bucket(
    target: Llama,
    head: DraftHead | None,
    *,
    bucket: int,
    tree: TreeShape | None,
    context: int,
    num_rounds: int,
    bandwidth: float,
    num_top_kernels: int = 0,
    prompt_length: int = 0,
) -> dict:
    """Plain (tree None) or speculative round latency of one bucket, and what it cost; with
    `num_top_kernels`, also the round's costliest kernels (`kernel_table`); with
    `prompt_length`, also the prefill of prompts that long (`prefill_ms`). Rounds are greedy,
    a stochastic tree's sampled (temperature 1)."""
    depth = 0 if tree is None else tree.depth
    config = EngineConfig(
        device="cuda",
        buckets=(bucket,),
        trees={bucket: tree},
        max_seq_len=context + (3 * num_rounds + 8) * (depth + 1),
        compile=True,
        cuda_graphs=True,
        policy="fixed",
    )
    decoder = Decoder(target, head if tree is not None else None, config)
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
    point = {
        "bucket": bucket,
        "mode": "plain" if tree is None else "speculative",
        "tree": None if tree is None else [tree.depth, tree.topk, tree.num_nodes],
        "stochastic": stochastic,
        "context": context,
        "warmup_s": time.perf_counter() - started,
        "graph_pool_mib": warmup.pool_bytes / 2**20,
    }
    refill()
    point["round_ms"] = time_replays(run, num_rounds=num_rounds) * 1e3
    refill()
    for key, host_loop in (("gpu_idle", True), ("gpu_idle_in_graph", False)):
        kernels = profile_kernels(run, bucket=bucket, num_rounds=num_rounds, host_loop=host_loop)
        point[key] = idle_fraction(kernels)
    point |= kernel_table(kernels, num_rounds=num_rounds, top=num_top_kernels)
    floor = floor_seconds(target, batch=bucket, context=context, bandwidth=bandwidth)
    point["floor_ms"] = floor * 1e3
    if tree is None:
        point["tokens_per_s"] = bucket / point["round_ms"] * 1e3
        point["floor_fraction"] = point["floor_ms"] / point["round_ms"]
    else:
        refill()
        point["draft_ms"] = _draft_phase_ms(head, state, tree, num_rounds=num_rounds)
        point["verify_ms"] = point["round_ms"] - point["draft_ms"]
    if prompt_length:
        point["prompt_length"] = prompt_length
        point["prefill_ms"] = prefill_ms(decoder, bucket, prompt_length=prompt_length)
    decoder.close()
    return point


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


def _draft_phase_ms(head: DraftHead, state: SpecState, tree: TreeShape, *, num_rounds) -> float:
    """The draft phase of a round alone, compiled and captured like the round."""
    step = compile_step(draft_phase, name="draft_phase")
    runner = CudaGraphRunner("cuda")
    runner.capture("draft", lambda: step(head, state, tree))
    try:
        return time_replays(lambda: runner.replay("draft"), num_rounds=num_rounds) * 1e3
    finally:
        runner.close()
