"""Round costs measured on the device, saved so that an engine starts with them: what the
`cost` policy (runtime/policies/) divides expected tokens by.

`measure` times every round a decoder may run in each bucket (each shape of its ladder, each
round variant, the captured graphs themselves on CUDA) over a state of done slots, and
returns a `CostProfile`: the identity of what was measured (device, torch and Triton
versions, dtype, the target's and head's shapes, compiled or eager, CUDA graphs or not) and
bucket -> round tag -> milliseconds. `specrun tune` writes it into the cache (`profile_path`),
`specrun compile` into its artifacts (`save_to_artifacts`: the rounds it built, measured as
it built them; `load_from_artifacts` when an engine starts from them); `load_into` seeds a
decoder's `RoundCosts` from a profile after checking it was measured for this decoder, and
refuses one measured for something else, saying how to rebuild it.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .aot import artifact_parts, expected_manifest
from .config import SamplingParams
from .decoder import Decoder
from .reports import host_lag
from .round_plan import RoundVariant
from .slots import restore_rows, save_rows

logger = logging.getLogger(__name__)

# The fields of an artifacts manifest that decide what a round costs; with whether the
# rounds are compiled (artifacts always are), a profile's identity.
MANIFEST_FIELDS = (
    "torch", "triton", "device", "capability", "dtype", "model", "head", "max_seq_len",
    "cuda_graphs",
)  # fmt: skip
IDENTITY_FIELDS = (*MANIFEST_FIELDS, "compiled")
# The profile in an artifacts directory (or in each part of one).
ARTIFACT_FILE = "cost_profile.json"


@dataclass(frozen=True)
class CostProfile:
    """identity: what was measured (IDENTITY_FIELDS); milliseconds: bucket -> round tag
    (RoundVariant.tag) -> mean milliseconds per round; created, command: provenance."""

    identity: dict[str, object]
    milliseconds: dict[int, dict[str, float]]
    created: str = ""
    command: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, path: Path) -> CostProfile:
        try:
            raw = json.loads(text)
            milliseconds = {
                int(bucket): {str(tag): float(ms) for tag, ms in rounds.items()}
                for bucket, rounds in raw["milliseconds"].items()
            }
            return cls(dict(raw["identity"]), milliseconds, raw["created"], raw["command"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(
                f"{path} is not a cost profile ({type(e).__name__}: {e}); delete it and run "
                "`specrun tune` again"
            ) from e


def identity(decoder: Decoder) -> dict[str, object]:
    """What a profile of this decoder's rounds depends on."""
    manifest = expected_manifest(decoder)
    found = {name: getattr(manifest, name) for name in MANIFEST_FIELDS}
    found["compiled"] = decoder.compiled
    return json.loads(json.dumps(found))  # tuples as lists, as a loaded profile has them


def profile_path(decoder: Decoder, root: str | Path) -> Path:
    """Where `specrun tune` keeps this decoder's profile under the cache root."""
    digest = hashlib.sha256(json.dumps(identity(decoder), sort_keys=True).encode()).hexdigest()
    return Path(root) / "profiles" / f"{digest[:16]}.json"


@torch.inference_mode()
def measure(
    decoder: Decoder,
    *,
    num_rounds: int = 10,
    filtered: bool = False,
    buckets: Sequence[int] | None = None,
    command: str = "",
) -> CostProfile:
    """Prepare and time every round the decoder's buckets (or `buckets` of them) may run
    (graphs replayed on CUDA, the compiled or eager step elsewhere) over states of done
    slots. `command`: the command line that measures it again."""
    milliseconds: dict[int, dict[str, float]] = {}
    for bucket in reversed(decoder.config.buckets if buckets is None else sorted(buckets)):
        rounds = milliseconds.setdefault(bucket, {})
        for variant in decoder.planner.variants(bucket, filtered=filtered):
            key = variant.cost_key
            if key.tag in rounds:
                continue  # the plain round that commits the pending pairs: rare, timed as one
            rounds[key.tag] = 1e3 * _time_round(decoder, bucket, variant, num_rounds)
    return CostProfile(
        identity(decoder),
        milliseconds,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        command=command,
    )


def _time_round(decoder: Decoder, bucket: int, variant: RoundVariant, num_rounds: int) -> float:
    """Median seconds of one round of `variant` over the bucket's state with every slot done
    (the slots' rows restored after, so requests may be decoding: see slots.save_rows)."""
    decoder.prepare(bucket, variant=variant)
    run = decoder.round_runner(bucket, variant=variant)
    state = decoder.state(bucket)
    saved = save_rows(state)
    state.done.fill_(True)
    try:
        run()  # a first run after preparing pays one-time costs
        return _median_seconds(run, num_rounds, cuda=decoder.device.type == "cuda")
    finally:
        restore_rows(state, saved)


def _median_seconds(run, num_rounds: int, *, cuda: bool) -> float:
    seconds = []
    for _ in range(num_rounds):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def load_into(decoder: Decoder, path: str | Path, *, rebuild: str) -> CostProfile:
    """Seed the decoder's round costs from the profile file at `path`. Raises ValueError if
    it was measured for another device, software or model, naming what differs and
    `rebuild`, the command that remakes it."""
    path = Path(path)
    profile = CostProfile.from_json(path.read_text(), path=path)
    current = identity(decoder)
    differs = [
        f"{name}={profile.identity.get(name)!r} (this process: {current[name]!r})"
        for name in IDENTITY_FIELDS
        if profile.identity.get(name) != current[name]
    ]
    if differs:
        raise ValueError(f"{path} was measured for {'; '.join(differs)}; rebuild it: {rebuild}")
    seed(decoder, profile)
    logger.info("round costs from %s", path)
    return profile


def seed(decoder: Decoder, profile: CostProfile) -> None:
    """Start the decoder's round costs at the profile's (the rounds it has a value for)."""
    for bucket in decoder.config.buckets:
        rounds = profile.milliseconds.get(bucket, {})
        for variant in decoder.planner.variants(bucket, filtered=True):
            key = variant.cost_key
            if key.tag in rounds:
                decoder.planner.costs.seed(bucket, key, rounds[key.tag] / 1e3)


def replay(decoder: Decoder, profile: CostProfile, params: Sequence[SamplingParams]) -> None:
    """Make the decoder's policy decide from `profile`, measured on another device or build
    of the same model and head, and keep its costs (frozen: the rounds run here are not
    timed into them), reading reports as many rounds late as the host does on that device
    (`reports.host_lag`: the policy then decides with what it would know there). Raises
    ValueError if the profile was measured for another model or head, or lacks a round that
    requests with any of `params` may run."""
    current = identity(decoder)
    names = ("model", "head") if decoder.head is not None else ("model",)
    differs = [name for name in names if profile.identity.get(name) != current[name]]
    if differs:
        raise ValueError(
            f"the cost profile was measured for another {' and '.join(differs)}; replay a "
            "profile of the same model and draft head"
        )
    missing = sorted(
        f"{bucket}:{variant.cost_key.tag}"
        for bucket in decoder.config.buckets
        for variant in decoder.planner.launchable(bucket, params)
        if variant.cost_key.tag not in profile.milliseconds.get(bucket, {})
    )
    if missing:
        raise ValueError(
            f"the cost profile has no cost for the rounds {', '.join(missing)}; measure them "
            "with `specrun tune` on that device under the same trees (--buckets, --filtered, "
            "--stochastic, --trees)"
        )
    seed(decoder, profile)
    decoder.planner.costs.frozen = True
    decoder.host_lag = host_lag(
        torch.device("cpu" if profile.identity.get("device", "cpu") == "cpu" else "cuda")
    )


def charged_seconds(profile: CostProfile, rounds_by_bucket: dict[str, int]) -> float:
    """What rounds counted as EngineStats.rounds_by_bucket ("bucket:tag" -> rounds) take at
    the profile's costs."""
    seconds = 0.0
    for key, num_rounds in rounds_by_bucket.items():
        bucket, tag = key.split(":", 1)
        rounds = profile.milliseconds.get(int(bucket), {})
        if tag not in rounds:
            raise ValueError(f"the cost profile has no cost for the round {key}")
        seconds += num_rounds * rounds[tag] / 1e3
    return seconds


def save_to_artifacts(
    decoder: Decoder,
    out: str | Path,
    *,
    filtered: bool,
    buckets: Sequence[int] | None = None,
    command: str = "",
) -> CostProfile:
    """Measure the rounds of `buckets` (default: all) that `specrun compile` just built into
    `out`, and write the profile there (ARTIFACT_FILE)."""
    profile = measure(decoder, filtered=filtered, buckets=buckets, command=command)
    (Path(out) / ARTIFACT_FILE).write_text(profile.to_json())
    return profile


def load_from_artifacts(decoder: Decoder, path: str | Path, *, rebuild: str) -> bool:
    """Seed the decoder's round costs from the profiles in artifacts `path` (one per part;
    refused as `load_into` does). Returns whether they cover every bucket."""
    covered: set[int] = set()
    for part in artifact_parts(path):
        file = part / ARTIFACT_FILE
        if file.is_file():
            covered.update(load_into(decoder, file, rebuild=rebuild).milliseconds)
    return set(decoder.config.buckets) <= covered
