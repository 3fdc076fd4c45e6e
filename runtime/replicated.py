"""A tensor-parallel engine's decoder on every rank: rank 0 decides, the others replay.

Each rank holds its shard of the target (models/tensor_parallel.py), a replicated draft head
and a `Decoder` of its own; their collectives meet inside the forwards, so every rank must run
the same device operations in the same order. Rank 0 runs the whole Engine (scheduler,
planner, reports) over a `ReplicatedDecoder`: before each operation that touches device
state it broadcasts a command (`DecoderOps` method name and picklable arguments: ints,
token-id lists, SamplingParams, RoundVariant) over the control group (runtime/ranks.py), then
runs it locally. The other ranks run `follow`: receive a command, run the same `DecoderOps`
method on their own decoder, until "close". So only rank 0 plans rounds (the `cost` policy
decides from rank 0's timings) and only rank 0 reads reports; the others never read a tensor
on the host.

The operations are those the scheduler and the engine call (`DecoderOps`); everything else
of the Decoder the proxy gives read-only (`READABLE`), and any other attribute raises, so a
new device operation cannot silently run on rank 0 alone.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..models.config import LlamaConfig
from ..models.eagle import DraftHead
from ..models.llama import Llama
from ..models.loading import load_draft, load_target
from ..models.tensor_parallel import local_config
from ..models.tokenizer import Tokenizer
from . import cost_profile
from .chunked_prefill import ChunkedPrefill
from .config import EngineConfig, SamplingParams
from .decoder import BucketWarmup, Decoder
from .ranks import Ranks, launched_by_torchrun
from .round_plan import RoundVariant

logger = logging.getLogger(__name__)

# Decoder attributes rank 0's proxy reads from its own decoder: its configuration and rank
# 0's host state (the planner, which only rank 0 consults; what is prepared), never changed
# through the proxy.
READABLE = frozenset(
    {
        "config", "device", "planner", "use_graphs", "compiled", "warmups", "max_depth",
        "num_slots", "target", "head", "eos_token_ids", "check_fits", "prefill_graphs",
        "admission_graphs", "compiled_steps", "host_lag",
    }
)  # fmt: skip


@dataclass
class _Chunked:
    """A chunked prefill in progress and the slot it was last run for (None before its
    first chunk)."""

    prefill: ChunkedPrefill
    slot: int | None = None


class DecoderOps:
    """The Decoder operations that touch device state, as every rank runs them; chunked
    prefills are named by keys rank 0 hands out, the same on every rank.

    Args:
        decoder: this rank's decoder.
        is_leader: whether this is rank 0 (which alone shows progress).
    """

    def __init__(self, decoder: Decoder, *, is_leader: bool) -> None:
        self.decoder = decoder
        self.is_leader = is_leader
        self.chunks: dict[int, _Chunked] = {}

    def prefill_batch(
        self,
        bucket: int,
        prompts: list[list[int]],
        params: list[SamplingParams],
        drafted: bool,
    ) -> torch.Tensor:
        """Decoder.prefill_batch: the report [bucket, 7] int64."""
        return self.decoder.prefill_batch(bucket, prompts, params, drafted=drafted)

    def admit(
        self,
        bucket: int,
        slots: list[int],
        prompts: list[list[int]],
        params: list[SamplingParams],
        drafted: bool,
    ) -> torch.Tensor:
        """Decoder.admit: the report [len(slots), 7] int64."""
        return self.decoder.admit(bucket, slots, prompts, params, drafted=drafted)

    def start_chunked_prefill(
        self, key: int, prompt: list[int], params: SamplingParams
    ) -> ChunkedPrefill:
        """Decoder.start_chunked_prefill, kept under `key`."""
        prefill = self.decoder.start_chunked_prefill(prompt, params)
        self.chunks[key] = _Chunked(prefill)
        return prefill

    def prefill_chunk(self, key: int, max_tokens: int, slot: int) -> torch.Tensor:
        """Decoder.prefill_chunk of the prefill under `key`, forgotten after its last chunk:
        the report [0 or 1, 7] int64."""
        chunked = self.chunks[key]
        chunked.slot = slot
        report = self.decoder.prefill_chunk(chunked.prefill, max_tokens, slot=slot)
        if chunked.prefill.finished:
            del self.chunks[key]
        return report

    def release(self, bucket: int, slots: list[int]) -> None:
        """Decoder.release; a chunked prefill whose slot is released (its request was
        cancelled) is dropped with its staging state."""
        self.decoder.release(bucket, slots)
        for key, chunked in list(self.chunks.items()):
            if chunked.slot in slots:
                del self.chunks[key]

    def move(self, bucket: int, sources: list[int], dests: list[int]) -> None:
        """Decoder.move; chunked prefills follow their slots."""
        self.decoder.move(bucket, sources, dests)
        moved = dict(zip(sources, dests, strict=True))
        for chunked in self.chunks.values():
            chunked.slot = moved.get(chunked.slot, chunked.slot)

    def prepare(self, bucket: int, variant: RoundVariant | None, prefill: bool) -> BucketWarmup:
        """Decoder.prepare."""
        return self.decoder.prepare(bucket, variant=variant, prefill=prefill)

    def warmup(
        self, *, progress: bool = False, **options: Any
    ) -> dict[tuple[int, RoundVariant], BucketWarmup]:
        """Decoder.warmup; the progress bar on rank 0 only."""
        return self.decoder.warmup(progress=progress and self.is_leader, **options)

    def round(self, bucket: int, variant: RoundVariant) -> torch.Tensor:
        """One round of the variant: the report [bucket, 6 + D + 1] int64."""
        return self.decoder.round_runner(bucket, variant=variant)()

    def measure_costs(self, filtered: bool) -> cost_profile.CostProfile:
        """cost_profile.measure: every rank runs the timed rounds; rank 0's times count."""
        return cost_profile.measure(self.decoder, filtered=filtered)

    def close(self) -> None:
        """Decoder.close, chunked prefills in progress dropped."""
        self.chunks.clear()
        self.decoder.close()


class ReplicatedDecoder:
    """Rank 0's decoder of a tensor-parallel engine: the Decoder interface the scheduler and
    the engine use, each device operation broadcast to the other ranks before it runs here.

    Args:
        decoder: rank 0's decoder.
        control: the group the commands go over (Ranks.control).
    """

    def __init__(self, decoder: Decoder, control: dist.ProcessGroup) -> None:
        self._decoder = decoder
        self._ops = DecoderOps(decoder, is_leader=True)
        self._control = control
        self._keys = itertools.count()
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        if name in READABLE:
            return getattr(self._decoder, name)
        raise AttributeError(
            f"Decoder.{name} is not available on a tensor-parallel engine: every device "
            "operation must run on every rank (add it to runtime/replicated.py's DecoderOps)"
        )

    def _run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Broadcast the command, then run it here."""
        dist.broadcast_object_list([(name, args, kwargs)], src=0, group=self._control)
        return getattr(self._ops, name)(*args, **kwargs)

    def prefill_batch(
        self,
        bucket: int,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        *,
        drafted: bool = True,
    ) -> torch.Tensor:
        """Decoder.prefill_batch on every rank; rank 0's report [bucket, 7] int64."""
        return self._run("prefill_batch", bucket, _lists(prompts), list(params), drafted)

    def admit(
        self,
        bucket: int,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        *,
        drafted: bool = True,
    ) -> torch.Tensor:
        """Decoder.admit on every rank; rank 0's report [len(slots), 7] int64."""
        return self._run("admit", bucket, list(slots), _lists(prompts), list(params), drafted)

    def start_chunked_prefill(
        self, prompt: Sequence[int], params: SamplingParams
    ) -> ChunkedPrefill:
        """Decoder.start_chunked_prefill on every rank; rank 0's ChunkedPrefill."""
        return self._run("start_chunked_prefill", next(self._keys), list(prompt), params)

    def prefill_chunk(self, chunked: ChunkedPrefill, max_tokens: int, *, slot: int) -> torch.Tensor:
        """Decoder.prefill_chunk on every rank; rank 0's report [0 or 1, 7] int64."""
        key = next(k for k, c in self._ops.chunks.items() if c.prefill is chunked)
        return self._run("prefill_chunk", key, max_tokens, slot)

    def release(self, bucket: int, slots: Sequence[int]) -> None:
        """Decoder.release on every rank."""
        self._run("release", bucket, list(slots))

    def move(self, bucket: int, sources: Sequence[int], dests: Sequence[int]) -> None:
        """Decoder.move on every rank."""
        self._run("move", bucket, list(sources), list(dests))

    def prepare(
        self, bucket: int, *, variant: RoundVariant | None = None, prefill: bool = True
    ) -> BucketWarmup:
        """Decoder.prepare on every rank; rank 0's BucketWarmup."""
        return self._run("prepare", bucket, variant, prefill)

    def warmup(self, **options: Any) -> dict[tuple[int, RoundVariant], BucketWarmup]:
        """Decoder.warmup on every rank (progress shown by rank 0 only)."""
        return self._run("warmup", **options)

    def round_runner(
        self, bucket: int, *, variant: RoundVariant | None = None
    ) -> Callable[[], torch.Tensor]:
        """A zero-argument call that runs one round on every rank (each call broadcast) and
        returns rank 0's report [bucket, 6 + D + 1] int64."""
        variant = variant or self._decoder.planner.variant_for(bucket, [SamplingParams()])
        return functools.partial(self._run, "round", bucket, variant)

    def measure_costs(self, *, filtered: bool) -> cost_profile.CostProfile:
        """cost_profile.measure over every rank's rounds: rank 0's profile."""
        return self._run("measure_costs", filtered)

    def close(self) -> None:
        """Tell the other ranks to close their decoders and stop following; close this one.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run("close")
        except RuntimeError as e:  # a rank is gone: its connection is closed
            logger.warning("the other ranks could not be told to close: %s", e)
            self._ops.close()


def follow(decoder: Decoder, control: dist.ProcessGroup) -> None:
    """Run rank 0's commands on this rank's decoder until it closes (or until the control
    group fails: rank 0 is gone)."""
    ops = DecoderOps(decoder, is_leader=False)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        name, args, kwargs = box[0]
        with torch.inference_mode():
            getattr(ops, name)(*args, **kwargs)
        if name == "close":
            return


def load_rank(
    ranks: Ranks, model_dir: str | Path, draft: str | Path | None, config: EngineConfig
) -> tuple[Llama, DraftHead | None, Tokenizer]:
    """This rank's shard of the target, the replicated draft head and the tokenizer, on the
    rank's device. Every rank learns whether all of them loaded: a failure on any rank raises
    ValueError on every rank, naming the first rank that failed and why."""
    error = None
    try:
        target = load_target(
            model_dir, dtype=config.resolved_dtype(), device=ranks.device, sharding=ranks.sharding
        )
        head = load_draft(draft, target=target) if draft is not None else None
        tokenizer = Tokenizer.from_dir(model_dir)
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        error = f"{type(e).__name__}: {e}"
    errors: list[str | None] = [None] * ranks.world_size
    dist.all_gather_object(errors, error, group=ranks.control)
    for rank, found in enumerate(errors):
        if found is not None:
            raise ValueError(f"rank {rank} of {ranks.world_size} could not load: {found}")
    return target, head, tokenizer


def follow_rank(
    ranks: Ranks, model_dir: str | Path, draft: str | Path | None, config: EngineConfig
) -> None:
    """A rank other than 0 of a tensor-parallel engine: load its shard and follow rank 0's
    commands until the engine closes."""
    config = rank_config(config, ranks)
    target, head, tokenizer = load_rank(ranks, model_dir, draft, config)
    decoder = Decoder(target, head, config, eos_token_ids=tokenizer.eos_token_ids)
    follow(decoder, ranks.control)
    logger.info("rank %d: the engine closed", ranks.rank)


def _lists(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    return [list(prompt) for prompt in prompts]


def rank_config(config: EngineConfig, ranks: Ranks) -> EngineConfig:
    """The config a rank's decoder runs with: the rank's own device."""
    return dataclasses.replace(config, device=str(ranks.device))


def check_tensor_parallel(
    model_dir: str | Path, config: EngineConfig, *, artifacts: str | Path | None
) -> None:
    """Refuse, before any process starts, a tensor-parallel engine that cannot run: a model
    whose heads, KV heads, MLP width or vocabulary do not divide by the number of ranks, a
    device index (ranks take cuda:0..N-1), too few GPUs, or artifacts (built for one
    process). ValueError saying what to change."""
    world_size = config.tensor_parallel
    if artifacts is not None:
        raise ValueError(
            "compiled artifacts are built for one process; drop artifacts= to run with "
            f"tensor_parallel={world_size} (its ranks compile their own rounds)"
        )
    model_config = LlamaConfig.from_json(model_dir)
    try:
        local_config(model_config, world_size)
    except ValueError as e:
        raise ValueError(f"EngineConfig(tensor_parallel={world_size}) for {model_dir}: {e}") from e
    device = torch.device(config.device) if config.device != "auto" else None
    if device is not None and device.index is not None:
        raise ValueError(
            f"device {config.device!r} names one GPU, but tensor-parallel rank r runs on cuda:r "
            "(cuda:LOCAL_RANK under torchrun); give device='cuda' and choose the GPUs with "
            "CUDA_VISIBLE_DEVICES"
        )
    if config.resolved_device().type == "cuda" and not launched_by_torchrun():
        found = torch.cuda.device_count()
        if found < world_size:
            raise ValueError(
                f"tensor_parallel={world_size} needs {world_size} GPUs, {found} visible; "
                f"lower tensor_parallel"
            )
