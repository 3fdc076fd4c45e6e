"""What one `specrun eval` point records and how its results print.

A point is one JSON line (`point_record`): the tree, the accepted lengths and their
histogram, tokens/s and where each side's time went, against plain decoding unless the run
measured the head alone; the per-category figures (`category_fields`) and the accepted
length's error over prompts with what `--compare` pairs two runs by (`error_fields`). The
tables print one row per point, and one column per category.
"""

from __future__ import annotations

from ..runtime.stats import EngineStats, RequestStats
from ..runtime.tree import TreeShape
from .eval_plot import tree_label
from .eval_stats import Z95, accepted_length


def category_fields(
    categories: list[str | None], per_request: list[RequestStats], request_prompts: list[int]
) -> dict[str, dict[str, float | int | None]]:
    """Per category (requests without one left out): the mean accepted length, pooled over
    its requests' rounds as the overall mean is ((accepted draft tokens + rounds) / rounds),
    its standard error over the category's prompts (None for one prompt), its rounds and
    its requests. No fields when no request has a category."""
    requests: dict[str, list[list[int]]] = {}
    prompts: dict[str, list[int]] = {}
    for category, stats, prompt in zip(categories, per_request, request_prompts, strict=True):
        if category is None:
            continue
        requests.setdefault(category, []).append([stats.num_rounds, stats.num_accepted])
        prompts.setdefault(category, []).append(prompt)
    if not requests:
        return {}
    names = sorted(requests)
    estimates = {c: accepted_length(requests[c], prompts[c]) for c in names}
    return {
        "accepted_length_by_category": {c: estimates[c].value for c in names},
        "accepted_length_stderr_by_category": {c: estimates[c].stderr for c in names},
        "rounds_by_category": {c: sum(r for r, _ in requests[c]) for c in names},
        "requests_by_category": {c: len(requests[c]) for c in names},
    }


def error_fields(
    per_request: list[RequestStats],
    request_prompts: list[int],
    request_categories: list[str | None],
    digest: str,
) -> dict:
    """The accepted length's standard error over prompts; each request's (rounds, accepted
    drafts) in the order `measure` returns them (what a live run and its replay,
    --cost-profile, compare request by request), with its prompt index and category
    (categories only when the prompts have them); and the prompts' digest: what `--compare`
    pairs two runs by."""
    requests = [[r.num_rounds, r.num_accepted] for r in per_request]
    estimate = accepted_length(requests, request_prompts)
    categories = {"request_categories": request_categories} if any(request_categories) else {}
    return {
        "accepted_length_stderr": estimate.stderr,
        "requests": requests,
        "request_prompts": request_prompts,
        **categories,
        "prompts_digest": digest,
    }


def point_record(
    shape: TreeShape,
    temperature: float,
    spec_stats: EngineStats,
    plain_stats: EngineStats | None,
    num_prompts: int,
    *,
    policy: str = "fixed",
) -> dict:
    """One JSON line: the batch size's tree (with an adaptive policy: the top of its ladder)
    at a temperature against plain decoding (its fields left out without `plain_stats`),
    with the rounds each shape ran, in all and per bucket ("bucket:round", what
    `cost_profile.charged_seconds` charges), and how many of the plain ones left the drafts
    behind."""
    record = {
        "policy": policy,
        "rounds_by_shape": spec_stats.rounds_by_shape,
        "rounds_by_bucket": spec_stats.rounds_by_bucket,
        "temperature": temperature,
        "num_prompts": num_prompts,
        "depth": shape.depth,
        "topk": shape.topk,
        "nodes": shape.num_nodes,
        "stochastic": shape.stochastic,
        "mean_accepted_length": spec_stats.mean_accepted_length,
        "accepted_histogram": spec_stats.accepted_histogram,
        "num_rounds": spec_stats.num_rounds,
        "num_rounds_drafts_behind": spec_stats.num_rounds_drafts_behind,
        "num_rounds_exploring": spec_stats.num_rounds_exploring,
        "num_generated_tokens": spec_stats.num_generated_tokens,
        "tokens_per_second": spec_stats.tokens_per_second,
        **time_breakdown(spec_stats),
    }
    if plain_stats is None:
        return record
    record.update(
        {
            "baseline_tokens_per_second": plain_stats.tokens_per_second,
            "speedup": spec_stats.tokens_per_second / max(plain_stats.tokens_per_second, 1e-9),
            **time_breakdown(plain_stats, prefix="baseline_"),
        }
    )
    record["decode_speedup"] = record["decode_tokens_per_second"] / max(
        record["baseline_decode_tokens_per_second"], 1e-9
    )
    return record


def time_breakdown(stats: EngineStats, *, prefix: str = "") -> dict:
    """Where the decoding time went: wall seconds, the prefills' and rounds' seconds (GPU time
    on CUDA), the mean round in milliseconds, the wall time outside both (host work the GPU
    waited for, tokenization, the last round launched after a request ended), and the tokens
    per second of the rounds alone (every token but each request's first, which its prefill
    samples)."""
    round_tokens = stats.num_generated_tokens - stats.num_requests
    return {
        f"{prefix}decode_tokens_per_second": round_tokens / max(stats.round_seconds, 1e-9),
        f"{prefix}wall_seconds": stats.decode_seconds,
        f"{prefix}prefill_seconds": stats.prefill_seconds,
        f"{prefix}round_seconds": stats.round_seconds,
        f"{prefix}round_ms": 1e3 * stats.round_seconds / max(stats.num_rounds, 1),
        f"{prefix}other_seconds": stats.decode_seconds
        - stats.prefill_seconds
        - stats.round_seconds,
    }


def format_table(records: list[dict]) -> str:
    """One row per tree shape (or policy), temperature and batch size: accepted length,
    tokens/s with and without the head (wall time, prefills included), the mean round and
    plain step, the speed-up of the rounds alone ('-' without plain decoding), and the rounds
    run, those that left the drafts behind and those the policy ran to explore."""
    header = (
        f"{'tree':>18} {'temp':>6} {'batch':>5} {'accept len':>10} {'+-95%':>6} {'spec tok/s':>11} "
        f"{'plain tok/s':>12} {'speedup':>8} {'round ms':>9} {'step ms':>8} "
        f"{'decode speedup':>15} {'rounds':>7} {'behind':>7} {'explored':>8}"
    )
    rows = [header, "-" * len(header)]
    for r in records:
        plain_tps = _cell(r, "baseline_tokens_per_second", 12, ".1f")
        speedup, step_ms = (
            _cell(r, "speedup", 7, ".3f", "x"),
            _cell(r, "baseline_round_ms", 8, ".3f"),
        )
        decode_speedup = _cell(r, "decode_speedup", 14, ".3f", "x")
        rows.append(
            f"{tree_label(r):>18} {r['temperature']:>6.2f} {r.get('batch_size', 1):>5} "
            f"{r['mean_accepted_length']:>10.2f} {_half_width(r):>6} "
            f"{r['tokens_per_second']:>11.1f} {plain_tps} {speedup} {r['round_ms']:>9.3f} "
            f"{step_ms} {decode_speedup} {r['num_rounds']:>7} "
            f"{r['num_rounds_drafts_behind']:>7} {r['num_rounds_exploring']:>8}"
        )
    return "\n".join(rows)


def _cell(record: dict, key: str, width: int, spec: str, suffix: str = "") -> str:
    """A plain-decoding column: '-' where the point measured none (--no-plain)."""
    if key not in record:
        return f"{'-':>{width + len(suffix)}}"
    return f"{record[key]:>{width}{spec}}{suffix}"


def _with_interval(value: float, stderr: float | None) -> str:
    return f"{value:.2f}" if stderr is None else f"{value:.2f}+-{Z95 * stderr:.2f}"


def _half_width(record: dict) -> str:
    stderr = record.get("accepted_length_stderr")
    return "n/a" if stderr is None else f"{Z95 * stderr:.2f}"


def format_category_table(records: list[dict]) -> str:
    """One row per point with categories, one column per category: mean accepted length and
    its 95% interval's half-width over the category's prompts."""
    categorised = [r for r in records if "accepted_length_by_category" in r]
    names = sorted({c for r in categorised for c in r["accepted_length_by_category"]})
    width = max(10, *(len(name) for name in names))
    header = f"{'tree':>18} {'temp':>6} {'batch':>5} " + " ".join(f"{n:>{width}}" for n in names)
    title = "accepted length (tokens per round) by category, +-95% over its prompts"
    rows = [title, header, "-" * len(header)]
    for r in categorised:
        lengths = r["accepted_length_by_category"]
        errors = r.get("accepted_length_stderr_by_category", {})
        cells = [
            f"{_with_interval(lengths[n], errors.get(n)):>{width}}" if n in lengths else " " * width
            for n in names
        ]
        rows.append(
            f"{tree_label(r):>18} {r['temperature']:>6.2f} {r.get('batch_size', 1):>5} "
            + " ".join(cells)
        )
    return "\n".join(rows)
