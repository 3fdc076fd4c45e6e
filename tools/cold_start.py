"""`specrun bench cold-start`: process start to first token, with and without artifacts.

Every point runs in a fresh Python process (`python -m specrun.tools.cold_start --child
SPEC`) with its own empty Inductor cache directory (unless `--warm-cache`), so nothing that
was compiled earlier on the machine is reused except what the artifacts bring. Modes:

- `jit`: compile everything in the process (Dynamo, Inductor, Triton, autotuning);
- `build`: compile and write the artifacts (what `specrun compile` does), timed the same way;
  run automatically before `artifacts` when `--artifacts` holds none for this setup;
- `artifacts`: verify and load the artifacts, then prepare every bucket from them.

Each point is one JSON line; times are seconds since the parent launched the child:
`import_s` (Python, torch and specrun imported), `weights_s` (model and head loaded from the
directory, or built with random weights), `artifacts_s` (loaded; build mode: written),
`warmup_s` (every bucket compiled or loaded, CUDA graphs captured), `first_token_s` (one
prompt prefilled and its first token on the host), `first_round_s` (the first decoding round
after it), with the step durations (`*_step_s`), `next_request_token_s` (a duration: a
second, shorter prompt's first token, i.e. what a first token costs once the process has
served one), `bucket_prepare_s` (each bucket's prepare: its prefill, round warm-up and
capture) and the process's compile counters. `--profile DIR` writes each child's cProfile
phase by phase (up to each mark) to DIR as `cold-MODE-N-PHASE.pstats`, with its top
functions in `.txt`. The models are driven through the Decoder the Engine runs (the Engine
adds only the tokenizer).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import os
import pstats
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

# The arguments a child process needs.
SPEC_KEYS = (
    "model", "draft", "random_8b", "plain", "artifacts", "buckets", "tree", "max_seq_len",
    "device", "dtype", "prompt_len", "filtered", "no_precompile", "only_buckets", "profile",
)  # fmt: skip


def register(subjects: argparse._SubParsersAction) -> None:
    """Add `cold-start` to `specrun bench`."""
    parser = subjects.add_parser(
        "cold-start", help="process start to first token, with and without compile artifacts"
    )
    parser.add_argument("--model", default=None, help="HF Llama directory (default: embedded)")
    parser.add_argument("--draft", default=None, help="EAGLE draft-head directory")
    parser.add_argument(
        "--random-8b",
        action="store_true",
        help="Llama-3.1-8B shapes with random bf16 weights and an EAGLE-3-shaped head",
    )
    parser.add_argument("--plain", action="store_true", help="--random-8b without a head")
    parser.add_argument("--artifacts", default=None, help="artifact directory (built if needed)")
    parser.add_argument(
        "--modes", nargs="+", default=None, choices=["jit", "build", "artifacts"],
        help="default: jit, plus artifacts with --artifacts",
    )  # fmt: skip
    parser.add_argument("--buckets", type=int, nargs="+", default=[1])
    parser.add_argument("--tree", type=int, nargs=3, default=None, metavar=("D", "K", "N"))
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--filtered", action="store_true", help="top-k/top-p variants too")
    parser.add_argument("--no-precompile", action="store_true", help="build: caches only")
    parser.add_argument(
        "--only-buckets", type=int, nargs="+", default=None, metavar="B",
        help="build: a part (some of --buckets) into --artifacts, e.g. DIR/part-1; artifacts: "
        "--artifacts DIR loads every part in it (`specrun compile --only-buckets`)",
    )  # fmt: skip
    parser.add_argument("--repeat", type=int, default=1, help="points per mode")
    parser.add_argument("--warm-cache", action="store_true", help="share the Inductor cache")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per child")
    parser.add_argument("--json", default=None, help="also write the JSON lines here")
    parser.add_argument(
        "--profile", default=None, metavar="DIR", help="write each child's cProfile to DIR"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    modes = args.modes or (["jit", "artifacts"] if args.artifacts else ["jit"])
    if ("build" in modes or "artifacts" in modes) and not args.artifacts:
        raise ValueError("modes build and artifacts need --artifacts DIR")
    spec = {key: getattr(args, key) for key in SPEC_KEYS}
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    if "artifacts" in modes and "build" not in modes and not _has_artifacts(args.artifacts):
        modes = ["build", *modes]
    sink = open(args.json, "w") if args.json else None  # noqa: SIM115
    try:
        for mode in modes:
            for index in range(1 if mode == "build" else args.repeat):
                point = _launch(spec | {"mode": mode, "index": index}, args)
                line = json.dumps(point)
                print(line, flush=True)
                if sink:
                    print(line, file=sink, flush=True)
    finally:
        if sink:
            sink.close()
    return 0


def _has_artifacts(path: str) -> bool:
    """Whether `path` holds artifacts, or parts of them in subdirectories."""
    from ..runtime.aot import artifact_parts
    from ..runtime.graphs.artifacts import MANIFEST_FILE

    return any((part / MANIFEST_FILE).is_file() for part in artifact_parts(path))


def _launch(spec: dict, args: argparse.Namespace) -> dict:
    """Run one point in a fresh process; returns its JSON report (or the failure)."""
    with tempfile.TemporaryDirectory(prefix="specrun-cold-") as cache:
        env = dict(os.environ)
        if not args.warm_cache:
            env["TORCHINDUCTOR_CACHE_DIR"] = cache
            env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
        launched = time.time()
        command = [sys.executable, "-m", "specrun.tools.cold_start", "--child"]
        command.append(json.dumps(spec | {"launched": launched}))
        try:
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            return {"mode": spec["mode"], "error": f"timed out after {args.timeout} s"}
        exit_s = time.time() - launched
    sys.stderr.write(done.stderr)  # the child's logs (and TORCH_LOGS output) stay visible
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"mode": spec["mode"], "error": done.stderr.strip().splitlines()[-20:]}
    return json.loads(lines[-1]) | {"exit_s": exit_s}


def _child(spec: dict) -> dict:
    """One point, inside the fresh process (profiled phase by phase with `--profile`)."""
    if not spec.get("profile"):
        return _point(spec, lambda name: None)
    stem = os.path.join(spec["profile"], f"cold-{spec['mode']}-{spec.get('index', 0)}")
    profiler = cProfile.Profile()

    def phase_done(name: str) -> None:
        nonlocal profiler
        profiler.disable()
        _write_profile(profiler, f"{stem}-{name.removesuffix('_s')}")
        profiler = cProfile.Profile()
        profiler.enable()

    profiler.enable()
    try:
        return _point(spec, phase_done)
    finally:
        profiler.disable()


def _write_profile(profiler: cProfile.Profile, stem: str) -> None:
    """The profile as pstats and as text (top functions by cumulative and own time)."""
    profiler.dump_stats(stem + ".pstats")
    with open(stem + ".txt", "w") as f:
        pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(80)
        pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(40)


def _point(spec: dict, phase_done: Callable[[str], None]) -> dict:
    """One point's timings and counters; `phase_done(mark)` is called at each mark."""
    launched = spec["launched"]
    marks: dict[str, float] = {}

    def mark(name: str) -> None:
        marks[name] = time.time() - launched
        phase_done(name)

    import torch

    from ..runtime import aot
    from ..runtime.config import EngineConfig, SamplingParams, default_trees
    from ..runtime.decoder import Decoder
    from ..runtime.graphs.artifacts import compile_counters
    from ..runtime.tree import TreeShape

    mark("import_s")
    trees = {1: TreeShape(*spec["tree"])} if spec["tree"] else default_trees(spec["draft"])
    config = EngineConfig(
        device=spec["device"], dtype=spec["dtype"], buckets=tuple(spec["buckets"]),
        trees=trees, max_seq_len=spec["max_seq_len"], compile=True,
    )  # fmt: skip
    target, head, model_name = _models(spec, config)
    _sync(torch)
    mark("weights_s")
    decoder = Decoder(target, head, config)
    mode, path = spec["mode"], spec["artifacts"]
    if mode == "build":
        aot.build(
            decoder,
            path,
            filtered=spec["filtered"],
            precompile=not spec["no_precompile"],
            buckets=spec["only_buckets"],
        )
        mark("artifacts_s")
    elif mode == "artifacts":
        rebuild = "specrun bench cold-start ... --modes build (same arguments)"
        aot.load_into(decoder, path, rebuild=rebuild, warmup=False)
        mark("artifacts_s")
    # A part's build serves from its own buckets: the others were never meant to compile.
    part = spec["only_buckets"] if mode == "build" else None
    decoder.warmup(filtered=spec["filtered"], buckets=part)
    _sync(torch)
    mark("warmup_s")
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.config.vocab_size, (spec["prompt_len"],), generator=generator)
    names = iter(("first_token_s", "first_round_s"))
    batch = [prompt.tolist()] * min(part or [1])
    for _step in decoder.stream(batch, SamplingParams(max_new_tokens=2)):
        mark(next(names, "last_round_s"))
    # A second request of another length: is the first request's prefill cost one-time?
    started = time.time()
    shorter = [prompt.tolist()[: spec["prompt_len"] // 2 + 1]] * len(batch)
    for _step in decoder.stream(shorter, SamplingParams(max_new_tokens=1)):
        pass
    marks["next_request_token_s"] = time.time() - started
    order = [name for name in ("import_s", "weights_s", "artifacts_s", "warmup_s") if name in marks]
    order.append("first_token_s")
    steps = {
        f"{name.removesuffix('_s')}_step_s": marks[name] - (marks[prev] if prev else 0.0)
        for prev, name in zip([None, *order], order, strict=False)
    }
    return {
        "mode": mode,
        "model": model_name,
        "draft": head is not None,
        "buckets": list(config.buckets),
        "only_buckets": spec["only_buckets"],
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        **marks,
        **steps,
        "bucket_prepare_s": {
            f"{bucket}:{variant.tag}": round(warmup.seconds, 3)
            for (bucket, variant), warmup in decoder.warmups.items()
        },
        **compile_counters(),
    }


def _models(spec: dict, config):
    """(target, head or None, a name) as the point asks: random Llama-3.1-8B shapes, or a
    directory loaded like Engine.from_pretrained loads it."""
    if spec["random_8b"]:
        from .random_models import LLAMA_31_8B, random_eagle3_head, random_target

        dtype, device = config.resolved_dtype(), str(config.resolved_device())
        target = random_target(LLAMA_31_8B, device=device, dtype=dtype)
        head = None if spec["plain"] else random_eagle3_head(
            target, draft_vocab_size=32000, dtype=dtype
        )  # fmt: skip
        return target, head, "Llama-3.1-8B shapes, random weights"
    from ..models.default import default_model_dir
    from ..runtime.engine import load_models

    model_dir = spec["model"] or default_model_dir()
    target, head = load_models(model_dir, spec["draft"] or None, config)
    return target, head, str(model_dir)


def _sync(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        # specrun's own INFO lines (artifact loading, bucket preparation) go to stderr,
        # which the parent passes through.
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        logging.getLogger("specrun").addHandler(handler)
        logging.getLogger("specrun").setLevel(logging.INFO)
        print(json.dumps(_child(json.loads(sys.argv[2]))), flush=True)
    else:
        sys.exit("usage: specrun bench cold-start ... (this module's --child is internal)")
