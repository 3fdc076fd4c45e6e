"""Per-bucket decoding state and the graphs that run it: rounds eagerly, compiled or as CUDA
graphs, prefill graphs, warm-up, and the slot operations continuous batching needs (admit,
chunked prefill, release, move), plus `stream`, the decoding of one static batch.

Every bucket's state is a view of the first `bucket` slots of one store (runtime/slots.py),
with pending buffers as wide as the deepest tree of any bucket, so live slots move between
buckets without recompiling or capturing anything. A static batch pads up to its bucket
(padding slots ask for no tokens and are done from the start), is prefilled into the bucket's
state and decoded round by round, each round the one the planner picks (runtime/round_plan.py:
a tree of the bucket's ladder or a plain step). The host reads one small
report per round, one round late (runtime/reports.py). Stop conditions are decided on the
device. The serving loop over these operations is runtime/scheduler.py.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..models.eagle import DraftHead
from ..models.llama import Llama
from .chunked_prefill import ChunkedPrefill
from .config import PADDING_PARAMS, EngineConfig, SamplingParams
from .graphs import CudaGraphRunner, compile_prefill, compile_round, compile_step
from .graphs.compile import CompiledStep
from .prefill import (
    allocate_state,
    mark_dynamic_dims,
    state_capacity,
)
from .prefill_runner import PrefillRunner
from .reports import ReportReader, SlotTracker, Step, host_lag, may_still_emit, row_signals
from .requests import check_requests
from .round import (
    ReportColumns,
    SpecState,
    appending_decode_round,
    decode_round,
    speculative_round,
    synced_decode_round,
)
from .round_plan import RoundPlanner, RoundVariant
from .slots import (
    copy_rows,
    copy_slots,
    max_prefill_rows,
    move,
    release,
    restore_rows,
    save_rows,
    slot_view,
)
from .stats import DecodeStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BucketWarmup:
    """What preparing one bucket's round variant cost: seconds (compilation included) and
    graph pool bytes."""

    bucket: int
    variant: RoundVariant
    seconds: float
    pool_bytes: int


class Decoder:
    """Decodes batches of token-id prompts with one target and an optional draft head.

    Args:
        target: the target model (on its device, in its dtype).
        head: the draft head, or None for plain decoding at every bucket.
        config: buckets, tree table, max_seq_len, compile and CUDA-graph choices.
        eos_token_ids: the model's end-of-sequence ids.
    """

    def __init__(
        self,
        target: Llama,
        head: DraftHead | None,
        config: EngineConfig,
        *,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.target = target
        self.head = head
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = target.lm_head.weight.device
        # Rounds the host reads reports behind the device (a replayed cost profile sets its
        # device's: cost_profile.replay).
        self.host_lag = host_lag(self.device)
        self.use_graphs = config.resolved_cuda_graphs()
        self.compiled = config.resolved_compile()
        self.planner = RoundPlanner(config, has_head=head is not None)
        self._round, self._decode = speculative_round, decode_round
        self._synced_decode = synced_decode_round
        self._appending_decode = appending_decode_round
        self._prefill_target = self._prefill_draft = None
        if self.compiled:
            # Greedy, sampled and top-k/top-p rounds of each bucket's shapes (RoundVariant).
            num_graphs = 3 * self.planner.num_shapes + 2
            self._round = compile_round(speculative_round, recompile_limit=num_graphs)
            self._decode = compile_step(decode_round, name="decode", recompile_limit=num_graphs)
            self._synced_decode = compile_step(
                synced_decode_round, name="synced_decode", recompile_limit=num_graphs
            )
            self._appending_decode = compile_step(
                appending_decode_round, name="appending_decode", recompile_limit=num_graphs
            )
            # Prefills are dynamic: one graph for batch 1 and one for larger batches, whatever
            # the buckets and prompt lengths (see prefill.py); the limit keeps the rounds'
            # slack all the same.
            num_prefills = num_graphs
            prefill_options = dict(recompile_limit=num_prefills, mark_dynamic=mark_dynamic_dims)
            self._prefill_target = compile_prefill(target, name="prefill_target", **prefill_options)
            self._prefill_draft = (
                compile_prefill(head, name="prefill_draft", **prefill_options)
                if head is not None
                else None
            )
        self._runner = CudaGraphRunner(self.device) if self.use_graphs else None
        # The pending buffers' width - 1 (RoundPlanner.max_depth).
        self.max_depth = self.planner.max_depth
        self._store: SpecState | None = None
        self._states: dict[int, SpecState] = {}
        self._prefills = PrefillRunner(
            target,
            head,
            config,
            self._runner,
            head_for=self._head_for,
            eos_token_ids=self.eos_token_ids,
            depth=self.max_depth,
            target_forward=self._prefill_target,
            draft_forward=self._prefill_draft,
        )
        self.warmups: dict[tuple[int, RoundVariant], BucketWarmup] = {}

    def check_fits(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]):
        """Refuse requests whose prompt + max_new_tokens exceed the slot capacity (for the
        deepest tree: a request may decode in any bucket)."""
        depth = self.max_depth
        for index, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            needed = state_capacity(len(prompt), p.max_new_tokens, depth)
            if needed > self.config.max_seq_len:
                raise ValueError(
                    f"prompt {index} ({len(prompt)} tokens) with max_new_tokens="
                    f"{p.max_new_tokens} needs {needed} KV positions (tree depth {depth}), "
                    f"more than max_seq_len={self.config.max_seq_len}; lower max_new_tokens "
                    "or raise EngineConfig(max_seq_len=...)"
                )

    def warmup(
        self,
        *,
        filtered: bool = False,
        progress: bool = False,
        buckets: Sequence[int] | None = None,
        prompt_lengths: Sequence[int] = (),
    ) -> dict[tuple[int, RoundVariant], BucketWarmup]:
        """Compile (and on CUDA capture) the round variants of every bucket (or only
        `buckets`, a subset of the config's), largest first: `variants(bucket,
        filtered=filtered)`; the top-k/top-p ones are otherwise prepared when first needed.
        With CUDA graphs, `prompt_lengths` (tokens) also captures the prefill graphs prompts
        that long need in those buckets, for batches and for admissions of up to a bucket's
        size of requests into running ones, with the head and, where the policy may decline
        to draft prompts (RoundPlanner.skips_drafts), without it (otherwise captured on
        first use). Idempotent."""
        chosen = self.config.buckets if buckets is None else sorted(buckets)
        keys = [
            (bucket, variant)
            for bucket in reversed(chosen)
            for variant in self.planner.variants(bucket, filtered=filtered)
        ]
        todo = [key for key in keys if key not in self.warmups]
        for bucket, variant in tqdm(todo, desc="warm-up", unit="graph", disable=not progress):
            self._build(bucket, variant)
        if self.use_graphs:
            # Prefills without the head too, where the policy may decline to draft prompts.
            drafted_kinds = (True, False) if self.planner.skips_drafts else (True,)
            for bucket in reversed(chosen):
                staging = self._prefills.staging(bucket)
                for num_tokens in sorted(set(prompt_lengths), reverse=True):
                    for drafted in drafted_kinds:
                        self._prefills.key(self.state(bucket), num_tokens, drafted=drafted)
                        self._prefills.key(staging, num_tokens, kind="admit", drafted=drafted)
        if todo or prompt_lengths:
            settle_heap()
        return dict(self.warmups)

    def prepare(
        self, bucket: int, *, variant: RoundVariant | None = None, prefill: bool = True
    ) -> BucketWarmup:
        """Compile one bucket's prefill (unless `prefill` is False) and round variant (by
        default the greedy round of its configured tree), and capture the round on CUDA.
        Idempotent. Returns its BucketWarmup. The bucket's state is left done (reset by the
        next prefill)."""
        variant = variant or self.planner.variant_for(bucket, [SamplingParams()])
        if self._build(bucket, variant, prefill=prefill):
            settle_heap()
        return self.warmups[bucket, variant]

    @torch.inference_mode()
    def _build(self, bucket: int, variant: RoundVariant, *, prefill: bool = True) -> bool:
        """`prepare` without settling the heap; whether anything was built."""
        key = (bucket, variant)
        if key in self.warmups:
            return False
        if variant not in self.planner.variants(bucket, filtered=True):
            shapes = self.planner.shapes(bucket)
            raise ValueError(f"bucket {bucket} runs none of {variant}; its shapes are {shapes}")
        started = time.perf_counter()
        if prefill:
            self._prefill_for_warmup(bucket)
        pool_bytes = self._prepare_round(bucket, variant)
        seconds = time.perf_counter() - started
        self.warmups[key] = BucketWarmup(bucket, variant, seconds, pool_bytes)
        logger.info("bucket %d%s ready in %.1f s", bucket, variant.tag, seconds)
        return True

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        *,
        stats: DecodeStats | None = None,
    ) -> Iterator[Step]:
        """Yield, after the prefill and after every round, (new tokens, finish reason or None)
        per prompt. `stats`, when given, is filled in as decoding goes."""
        prompts, params = check_requests(prompts, params, vocab_size=self.target.config.vocab_size)
        bucket = self.config.bucket_for(len(prompts))
        self.check_fits(prompts, params)
        stats = stats if stats is not None else DecodeStats()
        stats.begin(depth=self.planner.depth_for(bucket), num_requests=len(prompts))
        padding = bucket - len(prompts)
        yield from self._decode_batch(
            bucket,
            [*prompts, *[[0]] * padding],
            [*params, *[PADDING_PARAMS] * padding],
            len(prompts),
            stats,
        )

    def close(self) -> None:
        """Free graphs, states and caches."""
        if self._runner is not None:
            self._runner.close()
        self._states.clear()
        self._prefills.close()
        self._store = None
        self.warmups.clear()

    def _decode_batch(
        self,
        bucket: int,
        prompts: list[list[int]],
        params: list[SamplingParams],
        num_real: int,
        stats: DecodeStats,
    ) -> Iterator[Step]:
        state = self.state(bucket)
        if self.use_graphs:
            # Captured before the prefill is timed (a first use's capture is not its prefill).
            for variant in self.planner.launchable(bucket, params):
                self.prepare(bucket, variant=variant)
            self._prefills.key(state, max(map(len, prompts)))
        yield from self._rounds(bucket, state, prompts, params, num_real, stats)

    @torch.inference_mode()
    def _rounds(self, bucket, state, prompts, params, num_real, stats):
        reader = ReportReader(self.device)
        started = time.perf_counter()
        reader.submit(functools.partial(self._prefills.run, state, prompts, params))
        rows, _, _ = reader.read()
        stats.prefill_seconds += time.perf_counter() - started
        tracker = SlotTracker(num_real)
        yield tracker.step(rows, stats, counts_round=False)
        book = self.planner.new_book()
        # Without trees nothing reads the acceptance estimates: no bookkeeping per slot.
        speculates = self.planner.speculates
        while not tracker.all_done:
            while len(reader) <= self.host_lag:
                live = _still_emitting(tracker, params, num_in_flight=len(reader))
                if not live:
                    break  # the rounds in flight end every request
                estimates = [book.get(s, kind=params[s].greedy) for s in live] if speculates else []
                variant = self.planner.plan(bucket, params, estimates)
                reader.submit(self.round_runner(bucket, variant=variant), tag=variant)
            rows, seconds, variant = reader.read()
            stats.round_seconds += seconds
            live = [slot for slot, done in enumerate(tracker.done) if not done]
            accepted = [rows[slot][ReportColumns.NUM_ACCEPTED] for slot in live]
            if speculates:
                for slot, num_accepted in zip(live, accepted, strict=True):
                    book.observe(slot, variant.tree, num_accepted, row_signals(rows[slot]))
            self.planner.done(bucket, variant, seconds, accepted)
            stats.count_shape(variant.tag)
            yield tracker.step(rows, stats, counts_round=True)
        stats.per_request.extend(tracker.request_stats())

    def _head_for(self, bucket: int) -> DraftHead | None:
        # Every bucket keeps the draft in step when any round may speculate: slots move.
        return self.head if self.planner.speculates else None

    @property
    def prefill_graphs(self) -> list[tuple[int, int]]:
        """The (bucket, padded prompt length) pairs whose batch prefill graphs are captured."""
        return self._prefills.graphs("prefill")

    @property
    def admission_graphs(self) -> list[tuple[int, int]]:
        """The (admission batch, padded prompt length) pairs whose admission graphs are
        captured."""
        return self._prefills.graphs("admit")

    def round_runner(
        self, bucket: int, *, variant: RoundVariant | None = None
    ) -> Callable[[], torch.Tensor]:
        """A zero-argument call that runs one round (the variant; by default the greedy round
        of the configured tree) of the bucket over its state (replaying its graph on CUDA) and
        returns the report [bucket, 6 + D + 1] int64."""
        variant = variant or self.planner.variant_for(bucket, [SamplingParams()])
        if self._runner is not None:
            self.prepare(bucket, variant=variant)
            return functools.partial(self._runner.replay, (bucket, variant))
        return self._round_step(bucket, variant)

    def compiled_steps(self) -> dict[str, CompiledStep]:
        """The compiled steps by name (round, decode, synced_decode, appending_decode,
        prefill_target, prefill_draft); empty with compilation off."""
        if not self.compiled:
            return {}
        steps = (
            self._round,
            self._decode,
            self._synced_decode,
            self._appending_decode,
            self._prefill_target,
            self._prefill_draft,
        )
        return {step.name: step for step in steps if step is not None}

    def _round_step(self, bucket: int, variant: RoundVariant) -> Callable[[], torch.Tensor]:
        """The bucket's round variant as a zero-argument call over its static state."""
        state = self.state(bucket)
        sampling = dataclasses.replace(
            state.sampling, filtered=variant.filtered, greedy=variant.greedy
        )
        state = dataclasses.replace(state, sampling=sampling)
        if variant.tree is not None:
            return functools.partial(self._round, self.target, self.head, state, variant.tree)
        if variant.num_pending:
            return functools.partial(
                self._synced_decode, self.target, self.head, state, num_pending=variant.num_pending
            )
        if variant.appends:
            return functools.partial(self._appending_decode, self.target, self.head, state)
        return functools.partial(self._decode, self.target, state)

    def _prepare_round(self, bucket: int, variant: RoundVariant) -> int:
        """Compile the bucket's round variant and capture it, by warm-up calls on the state
        with every slot done; the slots' small tensors are restored afterwards, so a variant
        can be prepared while requests decode (see slots.save_rows)."""
        step = self._round_step(bucket, variant)
        state = self.state(bucket)
        saved = save_rows(state)
        state.done.fill_(True)
        try:
            if self._runner is None:
                step()
                return 0
            return self._runner.capture((bucket, variant), step).pool_bytes
        finally:
            restore_rows(state, saved)

    def _prefill_for_warmup(self, bucket: int) -> None:
        """A prefill at the bucket's batch size (compiles the prefill forwards)."""
        prompts = [[0, 0]] * bucket
        self._prefills.run(self.state(bucket), prompts, [PADDING_PARAMS] * bucket)

    def state(self, bucket: int) -> SpecState:
        """The bucket's state: views of the store's first `bucket` slots."""
        if bucket not in self._states:
            self._states[bucket] = slot_view(self._store_for(bucket), bucket)
        return self._states[bucket]

    def _store_for(self, bucket: int) -> SpecState:
        """The state of every slot: for the largest bucket with graphs or compiled steps (the
        steps' guards hold the strides of its views: the same whatever order buckets are
        first used in, as artifacts built in another process need); eagerly, grown to what is
        needed, keeping the slots' contents (growing drops the views of the old store)."""
        num_slots = self.config.buckets[-1] if self.compiled or self.use_graphs else bucket
        old = self._store
        if old is None or old.root.shape[0] < num_slots:
            self._states.clear()
            self._store = allocate_state(
                self.target,
                self.head,
                batch_size=num_slots,
                capacity=self.config.max_seq_len,
                depth=self.max_depth,
            )
            if old is not None:
                copy_slots(old, slot_view(self._store, old.root.shape[0]))
        return self._store

    @property
    def num_slots(self) -> int:
        """Slots of the largest bucket: what a running batch may grow to."""
        return self.config.buckets[-1]

    def admit(
        self,
        bucket: int,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        *,
        drafted: bool = True,
    ) -> torch.Tensor:
        """Prefill new requests into free `slots` of the bucket's state, the others keeping
        theirs (PrefillRunner.admit: an admission graph on CUDA; without `drafted`, the head
        does not run over the prompts). Returns their prefill report [len(slots), 7] int64."""
        return self._prefills.admit(self.state(bucket), slots, prompts, params, drafted=drafted)

    def start_chunked_prefill(
        self, prompt: Sequence[int], params: SamplingParams
    ) -> ChunkedPrefill:
        """A prefill of one prompt into a staging state of its own, run chunk by chunk with
        `prefill_chunk` (runtime/chunked_prefill.py); chunks padded and capped as other
        prefills are (`max_prefill_rows`)."""
        return ChunkedPrefill(
            self.target,
            self.head,
            prompt,
            params,
            eos_token_ids=self.eos_token_ids,
            depth=self.max_depth,
            max_rows=max_prefill_rows(self.device),
        )

    def prefill_chunk(self, chunked: ChunkedPrefill, max_tokens: int, *, slot: int) -> torch.Tensor:
        """Run the next chunk (at most `max_tokens` prompt tokens) of a chunked prefill with
        the plain modules; after its last, install its staging state into `slot` (free, done)
        as `admit` does. Returns an empty report [0, 7] int64 before the last chunk, the
        prefill report [1, 7] int64 after it."""
        report = chunked.run(max_tokens)
        if chunked.finished:
            staging = chunked.staging
            state = self.state(self.config.bucket_for(slot + 1))
            copy_rows(staging, state, [slot], num_positions=staging.output.shape[1])
        return report

    def prefill_batch(
        self,
        bucket: int,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        *,
        drafted: bool = True,
    ) -> torch.Tensor:
        """Reset the bucket's state for a fresh batch (one request per slot, padding
        included) and prefill it, replaying its prefill graph on CUDA when it fits; without
        `drafted`, the head does not run over the prompts (RoundPlanner.drafts_prompts).
        Returns the prefill report [bucket, 7] int64."""
        return self._prefills.run(self.state(bucket), prompts, params, drafted=drafted)

    def release(self, bucket: int, slots: Sequence[int]) -> None:
        """Mark slots of the bucket's state done (slots.release)."""
        release(self.state(bucket), slots)

    def move(self, bucket: int, sources: Sequence[int], dests: Sequence[int]) -> None:
        """Move live slots of the bucket's state into free ones (slots.move)."""
        move(self.state(bucket), sources, dests)


def _still_emitting(
    tracker: SlotTracker, params: Sequence[SamplingParams], *, num_in_flight: int
) -> list[int]:
    """The slots not done that a round launched now may still emit for (`may_still_emit`)."""
    return [
        slot
        for slot, done in enumerate(tracker.done)
        if not done
        and may_still_emit(params[slot].max_new_tokens - tracker.num_tokens[slot], num_in_flight)
    ]


def settle_heap() -> None:
    """Collect garbage, then exempt every object still alive from future collections.
    Compiling and capturing leave millions of long-lived objects (FX graphs, guards,
    generated code); a full collection scanning them stalls the host for up to half a second
    (H100 eval: 8 of up to 569 ms), mid-decode with the GPU idle if it lands there."""
    gc.collect()
    gc.freeze()
