"""Ahead-of-time compile artifacts for a Decoder: what to compile, what must match, loading.

`build` compiles everything a decoder will run, inside a private recording scope
(runtime/graphs/artifacts.py), and writes the artifact directory:

- everything `Decoder.warmup` compiles: every bucket's round variants (`RoundVariant`: a
  stochastic tree's sampled and greedy rounds, the top-k/top-p one) and the prefills (the
  prompt forwards of the target and the draft head; dynamic shapes and prompts padded to 3
  tokens, so the warm-up prompt covers every length: one graph for batch 1, one for larger
  batches), CUDA graphs included;
- with `precompile`, every one of those graphs compiled through Dynamo's precompile
  (`precompiling`, `CompiledStep.aot_compile`) rather than `torch.compile`, once
  each, so that loading skips Dynamo tracing too.

`expected_manifest` is the decoder's fingerprint: torch / triton / Python, device, dtype,
model and head configs, buckets and their trees, KV capacity, CUDA graphs on or off, and the
specrun source of the steps. A build may be split into parts (`build(..., buckets=...)`),
each an artifact directory of its own under one parent. `load_into` verifies an artifact
directory (or every part in one) against it (a mismatch is a ValueError naming the field and
the command that rebuilds), loads the caches and precompiled steps into the process and
warms the decoder up from them: no Inductor lowering, no Triton compilation or autotuning,
and no Dynamo tracing for precompiled graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shlex
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from .config import EngineConfig, default_trees, stochastic_trees
from .decoder import Decoder
from .graphs import artifacts
from .graphs.artifacts import LoadedArtifacts, Manifest
from .tree import TreeShape

logger = logging.getLogger(__name__)


def artifact_config(config: EngineConfig) -> EngineConfig:
    """The config with compilation on (artifacts are compiled code)."""
    if config.compile is False:
        raise ValueError("artifacts hold compiled steps: use EngineConfig(compile=True or None)")
    return dataclasses.replace(config, compile=True)


def expected_manifest(decoder: Decoder) -> Manifest:
    """What artifacts for this decoder must have been built for."""
    target, head, config = decoder.target, decoder.head, decoder.config
    return artifacts.current_manifest(
        device=decoder.device,
        dtype=target.lm_head.weight.dtype,
        model=(target.config, tuple(target.tap_layers)),
        head=None if head is None else (type(head).__name__, head.config),
        buckets=config.buckets,
        trees=[decoder.planner.shapes(bucket) for bucket in config.buckets],
        max_seq_len=config.max_seq_len,
        cuda_graphs=decoder.use_graphs,
    )


def compile_command(
    *, model_dir: str | Path | None, draft: str | Path | None, config: EngineConfig, out: str | Path
) -> str:
    """The `specrun compile` command line that builds artifacts for this setup."""
    args = ["specrun", "compile"]
    if model_dir is not None:
        args += ["--model", str(model_dir)]
    if draft is not None:
        args += ["--draft", str(draft)]
    elif model_dir is None:
        args.append("--no-draft")
    args += ["--buckets", *map(str, config.buckets), "--max-seq-len", str(config.max_seq_len)]
    args += ["--device", config.device, "--dtype", config.dtype]
    if config.cuda_graphs is False:
        args.append("--no-cuda-graphs")
    if config.policy != "cost":
        args += ["--policy", config.policy]
    trees, table, note = dict(config.trees), dict(default_trees(draft)), ""
    if trees != table:
        shape = next(iter(trees.values()))
        if trees == stochastic_trees(table):
            args.append("--stochastic")
        elif len(trees) == 1 and isinstance(shape, TreeShape):
            args += ["--tree", str(shape.depth), str(shape.topk), str(shape.num_nodes)]
            args += ["--stochastic"] * shape.stochastic
        else:
            note = " (with this EngineConfig's trees: specrun.runtime.aot.build from Python)"
    return shlex.join([*args, "--out", str(out)]) + note


def build(
    decoder: Decoder,
    out: str | Path,
    *,
    filtered: bool = True,
    precompile: bool = True,
    progress: bool = False,
    command: str = "",
    buckets: Sequence[int] | None = None,
) -> Manifest:
    """Compile every step of `decoder` and write the artifacts to `out` (replacing what was
    there once complete). Resets Dynamo's in-process state (and the decoder, if it was
    warmed up). Returns the written manifest.

    filtered: also compile the top-k/top-p variant of every round.
    precompile: compile through Dynamo's precompile and save the precompiled steps (loading
        then skips tracing).
    buckets: only these of the decoder's buckets, a part of a build: parts built in separate
        processes (or machines with the same GPU) as subdirectories of one directory load
        together (`load_into`).
    """
    built = _part_buckets(decoder, buckets)
    current = expected_manifest(decoder)
    if decoder.warmups:
        decoder.close()  # prepared steps would not be compiled (and recorded) again
    with artifacts.recording() as recording, torch.inference_mode():
        with precompiling(decoder, recording.steps.__setitem__) if precompile else nullcontext():
            decoder.warmup(filtered=filtered, progress=progress, buckets=built)
        manifest = dataclasses.replace(current, built=built, filtered=filtered, command=command)
        return artifacts.save(recording, out, manifest)


def is_up_to_date(
    decoder: Decoder,
    out: str | Path,
    *,
    filtered: bool = True,
    precompile: bool = True,
    buckets: Sequence[int] | None = None,
) -> bool:
    """Whether `out` (one build, or a directory of parts) holds intact artifacts for this
    decoder with at least what `build` would write with these options (so building again
    can be skipped)."""
    current, built = expected_manifest(decoder), set()
    for part in artifact_parts(out):
        if not artifacts.is_up_to_date(part, current):
            return False
        found = artifacts.read_manifest(part, rebuild="")
        if (filtered and not found.filtered) or (precompile and not found.precompiled):
            return False
        built.update(found.built)
    return built.issuperset(_part_buckets(decoder, buckets))


def split_buckets(buckets: Sequence[int], num_parts: int) -> list[tuple[int, ...]]:
    """`buckets` dealt largest first into at most `num_parts` parts of similar cost."""
    if num_parts < 1:
        raise ValueError(f"the number of parts must be at least 1, not {num_parts}")
    parts: list[list[int]] = [[] for _ in range(min(num_parts, len(buckets)))]
    for index, bucket in enumerate(sorted(buckets, reverse=True)):
        parts[index % len(parts)].append(bucket)
    return [tuple(sorted(part)) for part in parts]


def _part_buckets(decoder: Decoder, buckets: Sequence[int] | None) -> tuple[int, ...]:
    if buckets is None:
        return tuple(decoder.config.buckets)
    unknown = sorted(set(buckets) - set(decoder.config.buckets))
    if not buckets or unknown:
        raise ValueError(
            f"buckets to build must be some of the config's {list(decoder.config.buckets)}, "
            f"not {list(buckets)}"
        )
    return tuple(sorted(set(buckets)))


def load_into(
    decoder: Decoder,
    path: str | Path,
    *,
    rebuild: str,
    warmup: bool = True,
    filtered: bool | None = None,
    progress: bool = False,
) -> LoadedArtifacts:
    """Verify `path` against the decoder (ValueError naming what differs; `rebuild` is the
    command that rebuilds), load the artifacts and, with `warmup`, prepare every bucket from
    them (`filtered`: the top-k/top-p variants too; default: if the artifacts have them).

    `path` is one build, or a directory of parts (`build(..., buckets=...)` into
    subdirectories) that together cover the decoder's buckets."""
    current, advice = expected_manifest(decoder), f"rebuild with `{rebuild}`"
    built: set[int] = set()
    parts = artifact_parts(path)
    for part in parts:  # refuse before loading anything into the process
        manifest = artifacts.read_manifest(part, rebuild=advice)
        artifacts.verify(manifest, current, path=part, rebuild=advice)
        built.update(manifest.built)
    missing = [bucket for bucket in decoder.config.buckets if bucket not in built]
    if missing:
        raise ValueError(
            f"artifacts in {path} hold buckets {sorted(built)} but this engine also needs "
            f"{missing}: build them into a subdirectory of it (`specrun compile ... "
            f"--only-buckets {' '.join(map(str, missing))} --out {Path(path) / 'part-N'}`), "
            f"or {advice}"
        )
    loaded = _merged([artifacts.load_artifacts(p, current, rebuild=advice) for p in parts])
    add_precompiled(decoder, loaded.steps)
    if warmup:
        variant = loaded.manifest.filtered if filtered is None else filtered
        decoder.warmup(filtered=variant, progress=progress)
    return loaded


def artifact_parts(path: str | Path) -> list[Path]:
    """The artifact directories `path` holds: itself if it has a manifest, else each
    subdirectory that has one (the parts of a build), else [path] (refused when loaded)."""
    path = Path(path)
    if (path / artifacts.MANIFEST_FILE).is_file():
        return [path]
    return sorted(p.parent for p in path.glob(f"*/{artifacts.MANIFEST_FILE}")) or [path]


def _merged(parts: Sequence[LoadedArtifacts]) -> LoadedArtifacts:
    """The parts of a build as one: every precompiled step of each (a step's functions are
    tried in turn, so two parts' prefill graphs for the same shapes are harmless)."""
    names = sorted({name for part in parts for name in part.steps})
    manifest = dataclasses.replace(
        parts[0].manifest,
        built=tuple(sorted({bucket for part in parts for bucket in part.manifest.built})),
        filtered=all(part.manifest.filtered for part in parts),
        precompiled=tuple(name for part in parts for name in part.manifest.precompiled),
    )
    steps = {name: sum((part.steps.get(name, ()) for part in parts), ()) for name in names}
    return LoadedArtifacts(manifest, steps, sum(part.seconds for part in parts))


def add_precompiled(decoder: Decoder, fns: Mapping[str, Sequence[Callable]]) -> None:
    """Hand ahead-of-time compiled functions ({step name: [...]}, see
    runtime/graphs/artifacts.py) to the decoder's compiled steps; a call runs the one whose
    guards pass instead of tracing."""
    steps = decoder.compiled_steps()
    if not steps:
        raise ValueError("precompiled steps need EngineConfig(compile=True)")
    for name, step in steps.items():
        step.add_precompiled(fns.get(name, ()))


@contextlib.contextmanager
def precompiling(decoder: Decoder, sink: Callable[[str, Any], None]) -> Iterator[None]:
    """Within the block every graph a compiled step of the decoder needs is compiled ahead of
    time and handed to `sink(name, fn)` (CompiledStep.precompiling): what a build records."""
    with contextlib.ExitStack() as stack:
        for step in decoder.compiled_steps().values():
            stack.enter_context(step.precompiling(sink))
        yield
