"""The Engine: load a model (and a draft head), turn requests into token ids, decode them by
continuous batching over the per-bucket compiled (and on CUDA graph-captured) decoder, turn
ids back into text.

With a draft head, buckets that have a draft tree decode speculatively; the others, and every
bucket without a head, decode plainly. Every request is validated here, before anything is
queued, so a bad request is refused with a ValueError/TypeError that says what to change and
never disturbs another. `submit`, `generate` and `stream` may be called from any number of
threads: one loop thread (runtime/scheduler.py) runs every request on the device.

With `EngineConfig(tensor_parallel=N)` the target is split over N ranks, one process each:
`from_pretrained` starts ranks 1..N-1 itself (runtime/ranks.py), or, in processes a launcher
such as torchrun started, joins them. The Engine lives on rank 0, whose decoder broadcasts
every device operation to the other ranks (runtime/replicated.py).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from ..models.default import cache_root, default_model_dir, resolve_draft
from ..models.eagle import DraftHead
from ..models.llama import Llama
from ..models.loading import load_draft, load_target
from ..models.packed_linear import pack_target_and_head, packs_linears
from ..models.tokenizer import Tokenizer
from . import aot, cost_profile
from .acceptance import MeasuredAcceptance
from .config import (
    EngineConfig,
    SamplingParams,
    default_trees,
    head_acceptance,
    validate_prompt_ids,
)
from .decoder import BucketWarmup, Decoder
from .handle import Delta, Output, RequestHandle
from .ranks import Ranks, join_ranks, launched_by_torchrun, spawn_ranks
from .replicated import (
    ReplicatedDecoder,
    check_tensor_parallel,
    follow_rank,
    load_rank,
    rank_config,
)
from .requests import check_requests
from .round_plan import RoundVariant
from .scheduler import Scheduler
from .stats import EngineStats
from .threads import run_in_passing_thread

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]


def load_models(
    model_dir: str | Path, draft: str | Path | None, config: EngineConfig
) -> tuple[Llama, DraftHead | None]:
    """The target and its head (None without `draft`) on `config`'s device and dtype, as
    every single-process engine loads them, so that whatever else builds a decoder for one
    (AOT artifacts, cold-start points) holds the same weights: eager CPU engines get
    oneDNN-packed linear weights."""
    device, dtype = config.resolved_device(), config.resolved_dtype()
    target = load_target(model_dir, dtype=dtype, device=device)
    head = load_draft(draft, target=target) if draft is not None else None
    if packs_linears(device, dtype) and not config.resolved_compile():
        num_packed = pack_target_and_head(target, head)
        logger.info("packed %d linear weights for oneDNN", num_packed)
    return target, head


class Engine:
    """Text in, text out. Build with `Engine.from_pretrained`; close with `close()` (or use
    it as a context manager).

    ranks: rank 0's place in a tensor-parallel run (`from_pretrained` passes it; `model` is
        then rank 0's shard).
    acceptance: what `head` was measured to accept (`from_pretrained` reads it from the
        head's trees.json: runtime/config.py, head_acceptance); the adaptive policies start
        from it.
    """

    def __init__(
        self,
        model: Llama,
        tokenizer: Tokenizer,
        config: EngineConfig,
        *,
        head: DraftHead | None = None,
        ranks: Ranks | None = None,
        acceptance: MeasuredAcceptance | None = None,
    ) -> None:
        if config.tensor_parallel > 1 and ranks is None:
            raise ValueError(
                "an Engine built from a model runs in one process; build a tensor-parallel "
                "one with Engine.from_pretrained(..., config=EngineConfig(tensor_parallel=N))"
            )
        self.model = model
        self.head = head
        self.tokenizer = tokenizer
        self.config = config
        self._ranks = ranks
        self.acceptance = acceptance if head is not None else None
        decoder = Decoder(model, head, config, eos_token_ids=tokenizer.eos_token_ids)
        decoder.planner.measured = self.acceptance
        self.decoder = decoder if ranks is None else ReplicatedDecoder(decoder, ranks.control)
        # Whether the policy's round costs came from a profile or a warm-up measurement.
        self._profiled = False
        try:
            self._load_cost_profile()
        except BaseException:
            self._close_ranks()
            raise
        self._scheduler = Scheduler(
            self.decoder,
            tokenizer=tokenizer,
            max_waiting=config.max_waiting,
            max_prefill_tokens=config.max_prefill_tokens,
            continuous=config.continuous_batching,
        )

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path | None = None,
        *,
        draft: str | Path | bool | None = None,
        config: EngineConfig | None = None,
        artifacts: str | Path | None = None,
    ) -> Engine | None:
        """Load an HF Llama directory (None: the embedded SmolLM2-135M-Instruct) and an EAGLE
        draft head for speculative decoding.

        draft: a draft-head directory; None (the default) is the shipped head with the
        embedded model and plain decoding with any other model; False decodes plainly.

        config: None for the defaults, with the draft head's recommended trees where its
        directory has them (`config.default_trees`).

        artifacts: a directory written by `specrun compile` for this model, head, config,
        torch and device (else ValueError: what differs, how to rebuild). Its compiled steps
        are loaded and every bucket is warmed up (and captured) from them before returning.

        With `config.tensor_parallel` N > 1 the target is split over N ranks
        (`_from_ranks`): this process becomes rank 0 and starts the others, unless a
        launcher started every rank (torchrun: RANK and WORLD_SIZE set, or the default
        process group initialised), in which case every rank calls `from_pretrained`, rank
        0 gets the Engine and the others serve it from inside this call, returning None
        once rank 0 closes the engine.
        """
        draft = resolve_draft(model_dir, draft)
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        config = config or EngineConfig(trees=default_trees(draft))
        if artifacts is not None:
            config = aot.artifact_config(config)
        command = dict(model_dir=model_dir, draft=draft, config=config, out=artifacts)
        model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        if config.tensor_parallel > 1:
            check_tensor_parallel(model_dir, config, artifacts=artifacts)
            return cls._from_ranks(model_dir, draft, config)
        load = functools.partial(cls._load, model_dir, draft, config, artifacts, command)
        if config.resolved_device().type == "cpu":
            return run_in_passing_thread(load)
        return load()

    @classmethod
    def _load(
        cls,
        model_dir: Path,
        draft: str | Path | None,
        config: EngineConfig,
        artifacts: str | Path | None,
        command: dict,
    ) -> Engine:
        """from_pretrained's work on one process: the model, the head, the Engine, and the
        artifacts' steps and cost profile when given."""
        started = time.perf_counter()
        model, head = load_models(model_dir, draft, config)
        logger.info("loaded %s in %.1f s", model_dir, time.perf_counter() - started)
        tokenizer, acceptance = Tokenizer.from_dir(model_dir), head_acceptance(draft)
        engine = cls(model, tokenizer, config, head=head, acceptance=acceptance)
        if artifacts is not None:
            rebuild = aot.compile_command(**command)
            aot.load_into(engine.decoder, artifacts, rebuild=rebuild)
            if engine.decoder.planner.policy.adaptive:
                covered = cost_profile.load_from_artifacts(
                    engine.decoder, artifacts, rebuild=rebuild
                )
                engine._profiled = engine._profiled or covered
        return engine

    @classmethod
    def _from_ranks(
        cls, model_dir: Path, draft: str | Path | None, config: EngineConfig
    ) -> Engine | None:
        """Start or join the ranks, load this rank's shard; rank 0 returns the Engine, the
        others (under a launcher) follow rank 0's commands until it closes, then return
        None."""
        world_size, device_type = config.tensor_parallel, config.resolved_device().type
        started = time.perf_counter()
        if launched_by_torchrun():
            ranks = join_ranks(world_size, device_type=device_type)
        else:
            args = (model_dir, draft, config)
            ranks = spawn_ranks(world_size, device_type=device_type, entry=follow_rank, args=args)
        try:
            if ranks.rank != 0:
                follow_rank(ranks, model_dir, draft, config)
                ranks.close()
                return None
            local = rank_config(config, ranks)
            model, head, tokenizer = load_rank(ranks, model_dir, draft, local)
            logger.info(
                "loaded rank 0 of %d of %s in %.1f s",
                world_size,
                model_dir,
                time.perf_counter() - started,
            )
            acceptance = head_acceptance(draft)
            return cls(model, tokenizer, local, head=head, ranks=ranks, acceptance=acceptance)
        except BaseException:
            ranks.close()
            raise

    def _close_ranks(self) -> None:
        """Stop the other ranks (they close their decoders) and leave the process groups."""
        if self._ranks is not None:
            self.decoder.close()
            self._ranks.close()

    def _load_cost_profile(self) -> None:
        """Seed the policy's round costs from `specrun tune`'s profile for this decoder, if
        there is one in the cache."""
        if not self.decoder.planner.policy.adaptive:
            return
        path = cost_profile.profile_path(self.decoder, cache_root())
        if path.is_file():
            cost_profile.load_into(self.decoder, path, rebuild="specrun tune")
            self._profiled = True

    def replay_cost_profile(
        self, profile: cost_profile.CostProfile, params: Sequence[SamplingParams]
    ) -> None:
        """Make the speculation policy decide from `profile`, measured on another device for
        the same model and head, for requests with any of `params`, and keep those costs
        whatever rounds take here: what that device's policy would choose, run here
        (cost_profile.replay; `specrun eval --cost-profile`)."""
        self._scheduler.call(lambda: cost_profile.replay(self.decoder, profile, params))
        self._profiled = True

    def warmup(
        self, *, filtered: bool = False, progress: bool = True, prompt_lengths: Sequence[int] = ()
    ) -> dict[tuple[int, RoundVariant], BucketWarmup]:
        """Compile and (on CUDA) capture every bucket's rounds, largest first; idempotent.
        `filtered` also prepares the top-k/top-p variants; `prompt_lengths` (in tokens, see
        `encode_prompt`) also captures the prefill graphs such prompts need. Returns what
        each (bucket, round variant) graph cost. Without it, a graph is prepared the first
        time it is used. Runs between rounds when requests are decoding."""
        return self._scheduler.call(
            lambda: self._warmup(
                filtered=filtered, progress=progress, prompt_lengths=prompt_lengths
            )
        )

    def _warmup(self, **options) -> dict[tuple[int, RoundVariant], BucketWarmup]:
        built = self.decoder.warmup(**options)
        if self.decoder.planner.policy.adaptive and not self._profiled:
            # Without a profile the cost policy measures what it just prepared.
            if self._ranks is not None:
                measured = self.decoder.measure_costs(filtered=options["filtered"])
            else:
                measured = cost_profile.measure(self.decoder, filtered=options["filtered"])
            cost_profile.seed(self.decoder, measured)
            self._profiled = True
        return built

    def stats(self) -> EngineStats:
        """A snapshot of the running totals and the current load."""
        return self._scheduler.stats()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every request submitted so far has finished and no round is in
        flight, so that `stats()` holds all of their work (rounds the loop launched ahead
        for requests that have finished included); False if `timeout` seconds pass first.
        Once the engine is closing it returns True at once (its requests end with it)."""
        return self._scheduler.wait_idle(timeout)

    def round_costs(self) -> dict[str, float]:
        """What the speculation policy takes each round to cost now, in milliseconds by
        "bucket:tag" (as `stats().rounds_by_bucket` names rounds): a profile's or warm-up's
        values, moved by the rounds timed since. Empty before warm-up or a first round."""
        return self._scheduler.call(self.decoder.planner.costs.milliseconds)

    def encode_prompt(self, prompt: Prompt, *, index: int = 0) -> list[int]:
        """Token ids of a prompt: strings get the chat template when the config asks for it."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError(f"prompt {index} is empty; give some text")
            if self.config.chat_template and self.tokenizer.has_chat_template:
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                ids = self.tokenizer.encode(text, add_special_tokens=False)
            else:
                ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = validate_prompt_ids(prompt, vocab_size=self.model.config.vocab_size, index=index)
        limit = self.model.config.max_position_embeddings
        if len(ids) >= limit:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; this model's context is {limit} tokens, "
                "shorten the prompt"
            )
        return ids

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        listener: Callable[[Delta], None] | None = None,
    ) -> RequestHandle:
        """Queue one request and return its handle at once (iterate its deltas or text,
        `cancel()` it, wait for its `result()`). Validated here: a bad request raises
        ValueError/TypeError; a full waiting queue raises EngineOverloadedError.

        listener: called on the loop thread with each Delta instead of queueing it in the
            handle; it must return at once (AsyncEngine hands deltas to its event loop)."""
        ids, params = self.encode_request(prompt, params)
        return self._scheduler.submit(ids, params, listener=listener)

    def encode_request(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> tuple[list[int], SamplingParams]:
        """One request's token ids and parameters, validated as `submit` does (ValueError /
        TypeError saying what to change)."""
        [ids], [params] = self._requests([prompt], params)
        return ids, params

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Output]:
        """Decode prompts (strings or token-id lists; one or a list) to completion, with one
        SamplingParams for all or one per prompt; outputs in prompt order. The prompts are
        queued together, so the loop admits them as one batch as far as slots and the prefill
        budget allow; requests beyond the waiting queue wait for room (with
        `EngineConfig(queue=False)`, lists larger than the largest bucket are refused)."""
        encoded, params = self._requests(prompts, params)
        handles: list[RequestHandle] = []
        try:
            handles = self._scheduler.submit_all(list(zip(encoded, params, strict=True)))
            return [handle.result() for handle in handles]
        finally:
            for handle in handles:
                handle.cancel()

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one request as tokens are decoded. The request is validated
        here, so a bad one raises at the call; it is queued when the first delta is asked
        for, and cancelled if the generator is closed before the end."""
        [ids], [params] = self._requests([prompt], params)
        return self._stream(ids, params)

    def _stream(self, ids: list[int], params: SamplingParams) -> Iterator[str]:
        handle = self._scheduler.submit(ids, params, block=True)
        try:
            yield from handle.text()
        finally:
            handle.cancel()

    def close(self) -> None:
        """Cancel every request, stop the loop, release graphs, caches and the models'
        memory; a tensor-parallel engine's other ranks close too and the processes it
        started exit."""
        self._scheduler.close()
        self.decoder.close()
        if self._ranks is not None:
            self._ranks.close()
        self.model = None
        self.head = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[1] is not None and self._ranks is not None:
            # Closing waits for the other ranks; an error that stopped one shows first.
            logger.error("closing the tensor-parallel engine after an error", exc_info=exc_info)
        self.close()

    def _requests(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> tuple[list[list[int]], list[SamplingParams]]:
        """Encode and validate every request before anything runs."""
        prompts = _prompt_list(prompts)
        encoded = [self.encode_prompt(p, index=i) for i, p in enumerate(prompts)]
        encoded, params = check_requests(
            encoded,
            SamplingParams() if params is None else params,
            vocab_size=self.model.config.vocab_size,
        )
        max_bucket = self.config.buckets[-1]
        if len(encoded) > max_bucket and not self.config.queue:
            raise ValueError(
                f"{len(encoded)} prompts is more than the largest bucket ({max_bucket}) and "
                "queueing is off; send fewer prompts or use EngineConfig(queue=True)"
            )
        self.decoder.check_fits(encoded, params)
        return encoded, params


def _prompt_list(prompts: object) -> list[Prompt]:
    """One prompt (a string or a list of token ids) or a list of them, as a list."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"prompts must be a string, a list of token ids, or a list of those; got "
            f"{type(prompts).__name__}{_TOLIST_HINT if hasattr(prompts, 'tolist') else ''}"
        )
    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt")
    if isinstance(prompts[0], int) and not isinstance(prompts[0], bool):
        return [prompts]
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, (str, list, tuple)):
            raise TypeError(
                f"prompt {index} must be a string or a list of token ids, got "
                f"{type(prompt).__name__}{_TOLIST_HINT if hasattr(prompt, 'tolist') else ''}"
            )
    return list(prompts)


_TOLIST_HINT = " (pass token ids as a list of ints: ids.tolist())"
