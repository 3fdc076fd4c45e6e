"""`specrun eval`: how well a draft head speculates for its model.

For each tree shape (run fixed, and with `--policy` each named speculation policy choosing
among the first tree's ladder), temperature and batch size: the prompts are decoded that many
at a time (alone by default) speculatively with the head, and compared with plain decoding of
the same prompts (no head, measured once per temperature and batch size with the same engine
settings; none with `--no-plain`; with `--plain-floor` a second plain engine measures them
again, and each point also holds the ratio of the two, `plain_floor`: the resolution of its
speed-up). Each point is one JSON line: mean accepted length (tokens per round) and its
standard error over prompts, the histogram of accepted draft tokens per round, tokens/s of
both and the speed-up, and where each side's time went (prefill, rounds on the GPU, the
rest). A table follows on stdout, and with several sides each side's accepted length paired
by prompt with the first side's (their difference and its 95% interval); `--plot` also draws
the histograms and the accepted length by tree shape (tools/eval_plot.py).
Prompts are JSON lines {"prompt": text} or {"prompt_ids": [ids]}, or a built-in split
("builtin:broad", ...). When prompts carry a "category", each point also holds the mean
accepted length of each category, pooled over its requests' rounds like the overall one, and
a second table gives them per point; prompts without a category count only in the totals.
With `--sequences` it measures the head on finished text instead (tools/eval_agreement.py);
what a point records and prints is tools/eval_report.py, its error and `--compare`
tools/eval_stats.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

from tqdm.auto import tqdm

from ..runtime import cost_profile
from ..runtime.config import (
    POLICY_NAMES,
    EngineConfig,
    SamplingParams,
    default_trees,
    stochastic_trees,
)
from ..runtime.distill.data import read_prompt_records
from ..runtime.engine import Engine
from ..runtime.stats import EngineStats, RequestStats
from ..runtime.tree import StaticTree, TreeShape
from .eval_agreement import run_agreement
from .eval_plot import check_plotting, plot_records, tree_label
from .eval_report import (
    category_fields,
    error_fields,
    format_category_table,
    format_table,
    point_record,
)
from .eval_stats import against_first_side, format_comparison, prompts_digest, run_compare
from .generate import add_compile_argument, add_tree_arguments, compile_choice, tree_shape


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help="acceptance and speed-up of a draft head")
    parser.add_argument("--model", default=None, help="HF Llama directory (default: embedded)")
    parser.add_argument("--draft", default=None, help="draft-head directory (required to decode)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--prompts",
        help='JSONL of {"prompt": ...} lines (optionally "category"), or builtin:broad, '
        "builtin:heldout, ...",
    )  # fmt: skip
    source.add_argument(
        "--sequences", nargs="+", metavar="FILE",
        help="instead of decoding prompts: the head's top-1 agreement per draft step on these "
        "finished sequences (train-draft writes them), teacher-forced; a fixed set orders "
        "heads without decoding's noise (tools/eval_agreement.py)",
    )  # fmt: skip
    source.add_argument(
        "--compare", nargs=2, type=Path, metavar=("BASE", "NEW"),
        help="instead of decoding: two `--json` results over the same prompts, each shared "
        "point's accepted length and NEW's difference from BASE with its 95%% interval, "
        "paired by prompt (tools/eval_stats.py)",
    )  # fmt: skip
    parser.add_argument(
        "--max-prompts", type=int, default=None, help="use the first N prompts (or sequences)"
    )
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1],
        help="decode the prompts this many at a time (each its own point; the prompts repeat "
        "to fill a batch larger than their number)",
    )  # fmt: skip
    add_tree_arguments(parser)
    add_compile_argument(parser)
    parser.add_argument(
        "--trees",
        type=parse_tree_shape,
        nargs="+",
        default=None,
        metavar="D,K,N",
        help="evaluate several tree shapes (instead of --depth/--topk/--nodes)",
    )
    parser.add_argument(
        "--policy", action="append", default=[], choices=POLICY_NAMES,
        help="also evaluate this speculation policy choosing among the (first) tree's ladder "
        "of shapes each round (repeatable); the trees alone run fixed",
    )  # fmt: skip
    parser.add_argument(
        "--default-trees", action="store_true",
        help="the policies choose among the ladders of the engine's default tree table (the "
        "head's trees.json over EngineConfig's defaults, a tree per batch size), as "
        "`specrun generate` and `serve` do, instead of the first tree's",
    )  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate the maximum")
    parser.add_argument(
        "--seed", type=int, default=None,
        help="every request's seed (default: none, fresh draws; a seeded sampling request "
        "never drafts a stochastic tree, so it measures the top-k tree's acceptance)",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="decode the prompts this many times at every point, plain decoding's included, "
        "and report the totals (a point that decodes for a second or two varies by 1-2%% "
        "from run to run)",
    )  # fmt: skip
    parser.add_argument(
        "--plain-floor", action="store_true",
        help="decode every point with a second plain engine as well and report its tokens/s "
        "over the first's (`plain_floor`): how far apart two identical plain runs read, the "
        "resolution of every speed-up against plain decoding",
    )  # fmt: skip
    parser.add_argument(
        "--no-plain", action="store_true",
        help="measure the head alone: no plain decoding, so no speed-ups (the accepted "
        "lengths, their intervals and the rounds' times; about half the time)",
    )  # fmt: skip
    parser.add_argument("--raw", action="store_true", help="no chat template")
    parser.add_argument("--json", default=None, help="also write the JSON lines to this file")
    parser.add_argument("--plot", default=None, help="also draw the results into this PNG")
    parser.add_argument(
        "--cost-profile", type=Path, default=None,
        help="a `specrun tune --out` profile of another device (same model and head): the "
        "policies decide from its costs, and every round is charged its milliseconds there "
        "instead of its time here, so the speed-ups are that device's as these requests "
        "accept (prefills and host time left out)",
    )  # fmt: skip
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.set_defaults(func=run)


def parse_tree_shape(text: str) -> TreeShape:
    """'D,K,N' -> TreeShape(D, K, N) (argparse reports a ValueError as a bad value)."""
    parts = text.split(",")
    if len(parts) != 3 or not all(part.strip().isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"a tree is DEPTH,TOPK,NODES (e.g. 5,8,32), not {text!r}")
    depth, topk, num_nodes = map(int, parts)
    try:
        return TreeShape(depth=depth, topk=topk, num_nodes=num_nodes)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    if args.compare:
        run_compare(*args.compare)
        return 0
    if args.draft is None:
        raise ValueError("--draft is required with --prompts or --sequences: the head to measure")
    if args.sequences:
        return run_agreement(args)
    shapes = _tree_shapes(args)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    if args.no_plain and args.plain_floor:
        raise ValueError("--plain-floor measures plain decoding twice: leave out --no-plain")
    if args.plot:
        check_plotting()
    records = read_prompt_records(args.prompts)[: args.max_prompts]
    prompts = [r.prompt if isinstance(r.prompt, str) else list(r.prompt) for r in records]
    categories = [r.category for r in records]
    digest = prompts_digest(prompts)
    if min(args.batch_sizes) < 1:
        raise ValueError(f"--batch-sizes must be positive, got {args.batch_sizes}")
    batch_sizes = sorted(set(args.batch_sizes))
    config = EngineConfig(
        device=args.device,
        dtype=args.dtype,
        chat_template=not args.raw,
        buckets=tuple(batch_sizes),
        trees={1: shapes[0]},
        policy="fixed",
        compile=compile_choice(args),
    )
    points = [(t, b) for t in args.temperatures for b in batch_sizes]
    # Loaded once; every side below is an engine of its own over these modules (an engine
    # allocates its caches and graphs when first used).
    loaded = Engine.from_pretrained(args.model, draft=args.draft, config=config)
    model, tokenizer, head = loaded.model, loaded.tokenizer, loaded.head
    profile = None
    if args.cost_profile is not None:
        text = args.cost_profile.read_text()
        profile = cost_profile.CostProfile.from_json(text, path=args.cost_profile)
    baselines = {}
    if not args.no_plain:
        plain = Engine(model, tokenizer, config)
        baselines = _plain_points(plain, args, prompts, points, profile)
    floors = {}
    if args.plain_floor:
        again = _plain_points(Engine(model, tokenizer, config), args, prompts, points, profile)
        for point, stats in again.items():
            floors[point] = stats.tokens_per_second / max(baselines[point].tokens_per_second, 1e-9)
    records = []
    # Each point's line is written as soon as it is measured: a run cut short keeps them.
    with Path(args.json).open("w") if args.json else contextlib.nullcontext() as json_file:
        sides = [(shape, "fixed") for shape in shapes] + [(shapes[0], name) for name in args.policy]
        for shape, policy in sides:
            trees = _policy_trees(args) if policy != "fixed" and args.default_trees else {1: shape}
            side_config = dataclasses.replace(config, trees=trees, policy=policy)
            spec = Engine(model, tokenizer, side_config, head=head, acceptance=loaded.acceptance)
            for temperature, batch_size in points:
                params = _params(args, temperature)
                spec_stats, per_request = measure(
                    spec, prompts, params, batch_size, profile=profile, repeats=args.repeats
                )
                record = point_record(
                    side_config.tree_for(batch_size),
                    temperature,
                    spec_stats,
                    baselines.get((temperature, batch_size)),
                    max(len(prompts), batch_size),
                    policy=policy,
                )
                request_categories = filled(categories, batch_size) * args.repeats
                request_prompts = filled(list(range(len(prompts))), batch_size) * args.repeats
                records.append(
                    {
                        **record,
                        "batch_size": batch_size,
                        "repeats": args.repeats,
                        **category_fields(request_categories, per_request, request_prompts),
                        **_policy_fields(spec, policy),
                        **error_fields(per_request, request_prompts, request_categories, digest),
                        **({"plain_floor": floors[temperature, batch_size]} if floors else {}),
                    }
                )
                line = json.dumps(records[-1])
                print(line, flush=True)
                if json_file is not None:
                    json_file.write(line + "\n")
                    json_file.flush()
            spec.close()
    if args.plot:
        plot_records(records, args.plot)
    print(format_table(records))
    if any("accepted_length_by_category" in record for record in records):
        print(format_category_table(records))
    paired = against_first_side(records)
    if paired:
        title = f"accepted length against {tree_label(records[0])} (base), paired by prompt"
        print(format_comparison(paired, title=title))
    return 0


def _plain_points(
    plain: Engine,
    args: argparse.Namespace,
    prompts: list,
    points: list[tuple[float, int]],
    profile: cost_profile.CostProfile | None,
) -> dict[tuple[float, int], EngineStats]:
    """Every (temperature, batch size) point decoded by `plain` (closed after)."""
    found = {}
    for temperature, batch_size in points:
        params = _params(args, temperature)
        found[temperature, batch_size], _ = measure(
            plain, prompts, params, batch_size, profile=profile, repeats=args.repeats
        )
    plain.close()
    return found


def _tree_shapes(args: argparse.Namespace) -> list[TreeShape]:
    if args.trees is None:
        return [tree_shape(args)]
    if any(getattr(args, name) is not None for name in ("depth", "topk", "nodes")):
        raise ValueError("give either --trees or --depth/--topk/--nodes, not both")
    shapes = (dataclasses.replace(s, stochastic=args.stochastic) for s in args.trees)
    return list(dict.fromkeys(shapes))


def _policy_trees(args: argparse.Namespace) -> Mapping[int, TreeShape | StaticTree | None]:
    """--default-trees: the table an engine with this head uses by default."""
    trees = default_trees(args.draft)
    return stochastic_trees(trees) if args.stochastic else trees


def _params(args: argparse.Namespace, temperature: float) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        max_new_tokens=args.max_new_tokens,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
    )


def measure(
    engine: Engine,
    prompts: list,
    params: SamplingParams,
    batch_size: int = 1,
    *,
    profile: cost_profile.CostProfile | None = None,
    repeats: int = 1,
) -> tuple[EngineStats, list[RequestStats]]:
    """Decode the prompts `batch_size` at a time (repeated to fill one batch if there are
    fewer: `filled`), all of them `repeats` times; returns the statistics of those requests
    only, and each request's own in the order of `filled(prompts, batch_size) * repeats`.
    The graphs (the rounds', and on CUDA the prefills' of every prompt length) are prepared
    and one untimed request is made first, so lazy initialisation is not charged to it. With
    a `profile` (of another device), the policy decides from its costs and the rounds are
    charged them (`charged`)."""
    if profile is not None:
        engine.replay_cost_profile(profile, [params])
    prompt_lengths = [len(engine.encode_prompt(prompt)) for prompt in prompts]
    engine.warmup(progress=False, prompt_lengths=prompt_lengths)
    engine.generate(prompts[0], _warmup_params(params))
    engine.wait_idle()  # the warm-up's last rounds are counted before the snapshot
    before = engine.stats()
    side = "plain"
    if engine.head is not None:
        side = "{} tree {},{},{}".format(engine.config.policy, *_shape_of(engine))
    repeated = filled(prompts, batch_size)
    batches = [repeated[i : i + batch_size] for i in range(0, len(repeated), batch_size)]
    desc = f"{side} T={params.temperature:g} B={batch_size}"
    per_request = []
    for batch in tqdm(batches * repeats, desc=desc, unit="batch"):
        per_request += [output.stats for output in engine.generate(batch, params)]
    engine.wait_idle()
    stats = engine.stats().since(before)
    return (stats if profile is None else charged(stats, profile)), per_request


def _policy_fields(spec: Engine, policy: str) -> dict:
    """What an adaptive policy's point adds: what it took each round to cost when the point
    ended (beside the fixed trees' measured round_ms: whether its choices followed from wrong
    costs)."""
    return {"policy_round_ms": spec.round_costs()} if policy != "fixed" else {}


def charged(stats: EngineStats, profile: cost_profile.CostProfile) -> EngineStats:
    """`stats` with its time replaced by what its rounds cost at the profile's milliseconds
    (no prefill or host time)."""
    seconds = cost_profile.charged_seconds(profile, stats.rounds_by_bucket)
    return dataclasses.replace(
        stats, decode_seconds=seconds, round_seconds=seconds, prefill_seconds=0.0
    )


def filled(items: list, batch_size: int) -> list:
    """`items`, repeated to fill one batch of `batch_size` if there are fewer."""
    return (items * -(-batch_size // len(items)))[: max(len(items), batch_size)]


def _shape_of(engine: Engine) -> tuple[int, int, int]:
    shape = engine.config.tree_for(1)
    return shape.depth, shape.topk, shape.num_nodes


def _warmup_params(params: SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=params.temperature, max_new_tokens=min(4, params.max_new_tokens)
    )
