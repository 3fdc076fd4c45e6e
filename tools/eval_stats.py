"""How far `specrun eval`'s accepted length can be trusted, and two runs compared paired.

A point's accepted length is a ratio pooled over its requests: (accepted draft tokens +
rounds) / rounds. Its standard error is the ratio estimator's (the delta method) over
prompts, not over requests or rounds: the requests of one prompt (`--repeats`, a batch
filled by repeating prompts) form one cluster, since greedy repeats decode the same text,
and rounds within a request are far from independent. Over `builtin:broad` the prompts,
not the head, make most of that error (about 0.09 tokens per round over 96 prompts), so
two heads compare on the same prompts paired: each prompt's contribution to both runs'
ratio is differenced before the error is taken (`specrun eval --compare BASE NEW`), over
all prompts and over each category's. Within one run the sides (trees, policies) share
their prompts, so `specrun eval` pairs each with the run's first side the same way
(`against_first_side`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .eval_plot import tree_label

# Two-sided 95% normal quantile: intervals are estimate +- Z95 * stderr.
Z95 = 1.959964

# What makes two records the same point of two runs.
POINT_KEYS = ("policy", "depth", "topk", "nodes", "stochastic", "temperature", "batch_size")


@dataclass(frozen=True)
class Estimate:
    """A ratio over prompts with its standard error (None with fewer than two prompts)."""

    value: float
    stderr: float | None
    num_prompts: int

    @property
    def half_width(self) -> float | None:
        """Half the width of the 95% interval."""
        return None if self.stderr is None else Z95 * self.stderr


def prompts_digest(prompts: Sequence[str | Sequence[int]]) -> str:
    """A short fingerprint of the prompts in order: two runs compare only when it matches."""
    text = json.dumps([p if isinstance(p, str) else list(p) for p in prompts])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def per_prompt(
    requests: Sequence[Sequence[int]], request_prompts: Sequence[int]
) -> dict[int, tuple[int, int]]:
    """Each prompt's (rounds, tokens) summed over its requests; `requests` holds each
    request's (rounds, accepted draft tokens), `request_prompts` its prompt's index."""
    if len(requests) != len(request_prompts):
        raise ValueError(
            f"{len(requests)} requests but {len(request_prompts)} prompt indices: the record "
            "is damaged"
        )
    totals: dict[int, tuple[int, int]] = {}
    for (rounds, accepted), prompt in zip(requests, request_prompts, strict=True):
        before_rounds, before_tokens = totals.get(prompt, (0, 0))
        totals[prompt] = (before_rounds + rounds, before_tokens + rounds + accepted)
    return totals


def _contributions(totals: dict[int, tuple[int, int]], prompts: list[int]) -> tuple[float, list]:
    """The pooled ratio and each prompt's linearised contribution to it (in `prompts`'s
    order): (tokens - ratio * rounds) / mean rounds, which sums to zero."""
    num_rounds = sum(totals[p][0] for p in prompts)
    if num_rounds == 0:
        return 0.0, [0.0] * len(prompts)
    ratio = sum(totals[p][1] for p in prompts) / num_rounds
    mean_rounds = num_rounds / len(prompts)
    return ratio, [(totals[p][1] - ratio * totals[p][0]) / mean_rounds for p in prompts]


def _stderr(contributions: list[float]) -> float | None:
    n = len(contributions)
    if n < 2:
        return None
    mean = sum(contributions) / n
    return math.sqrt(sum((c - mean) ** 2 for c in contributions) / (n * (n - 1)))


def accepted_length(requests: Sequence[Sequence[int]], request_prompts: Sequence[int]) -> Estimate:
    """The pooled accepted length of these requests and its standard error over prompts."""
    totals = per_prompt(requests, request_prompts)
    prompts = sorted(totals)
    ratio, contributions = _contributions(totals, prompts)
    return Estimate(ratio, _stderr(contributions), len(prompts))


def accepted_length_difference(base: dict, new: dict) -> Estimate:
    """`new`'s accepted length minus `base`'s, two records of the same point over the same
    prompts, with the standard error of the difference paired by prompt."""
    return _paired(base, new)[2]


def _paired(base: dict, new: dict) -> tuple[float, float, Estimate]:
    """Both records' pooled accepted lengths and their paired difference."""
    for record, name in ((base, "base"), (new, "new")):
        if "request_prompts" not in record or "prompts_digest" not in record:
            raise ValueError(
                f"the {name} record has no per-prompt requests: rerun it with this version "
                "of `specrun eval --json`"
            )
    if base["prompts_digest"] != new["prompts_digest"]:
        raise ValueError(
            "the two runs decoded different prompts (their prompts_digest differ): compare "
            "runs made with the same --prompts and --max-prompts"
        )
    base_totals = per_prompt(base["requests"], base["request_prompts"])
    new_totals = per_prompt(new["requests"], new["request_prompts"])
    if sorted(base_totals) != sorted(new_totals):
        raise ValueError("the two runs decoded different sets of prompts: compare full runs")
    prompts = sorted(base_totals)
    base_ratio, base_parts = _contributions(base_totals, prompts)
    new_ratio, new_parts = _contributions(new_totals, prompts)
    paired = [n - b for n, b in zip(new_parts, base_parts, strict=True)]
    return base_ratio, new_ratio, Estimate(new_ratio - base_ratio, _stderr(paired), len(prompts))


def _paired_entry(base: dict, new: dict) -> dict:
    """A comparison's numbers: both accepted lengths, the difference, its 95% half-width
    and the prompts it pairs."""
    base_ratio, new_ratio, difference = _paired(base, new)
    return {
        "base_accepted_length": base_ratio,
        "accepted_length": new_ratio,
        "difference": difference.value,
        "difference_half_width": difference.half_width,
        "num_prompts": difference.num_prompts,
    }


def point_key(record: dict) -> tuple:
    return tuple(record.get(key) for key in POINT_KEYS)


def read_records(path: Path) -> list[dict]:
    """The JSON lines `specrun eval --json` wrote."""
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise ValueError(f"cannot read eval results {path}: {error.strerror}") from None
    records = [json.loads(line) for line in lines if line.strip()]
    if not records or any("mean_accepted_length" not in r for r in records):
        raise ValueError(f"{path} is not the output of `specrun eval --json`")
    return records


def compare_runs(base: list[dict], new: list[dict]) -> list[dict]:
    """Every point both runs measured: base and new accepted length, and the paired
    difference with its 95% half-width, in all and per category (`by_category`, empty when
    the prompts have none)."""
    base_points = {point_key(r): r for r in base}
    rows = []
    for record in new:
        other = base_points.get(point_key(record))
        if other is not None:
            rows.append(_comparison_row(other, record, _compare_categories(other, record)))
    if not rows:
        raise ValueError(
            "the two runs share no point (tree, temperature, batch size and policy): nothing "
            "to compare"
        )
    return rows


def against_first_side(records: list[dict]) -> list[dict]:
    """Within one run: every side's record paired by prompt with the run's first side at the
    same temperature and batch size (rows as `compare_runs` gives, without categories); none
    where a point has one side."""
    firsts: dict[tuple, dict] = {}
    rows = []
    for record in records:
        point = (record["temperature"], record.get("batch_size"))
        first = firsts.setdefault(point, record)
        if first is not record:
            rows.append(_comparison_row(first, record, {}))
    return rows


def _comparison_row(base: dict, new: dict, by_category: dict[str, dict]) -> dict:
    """One compared point: `new`'s point keys, the paired entry and the categories'."""
    return {
        **{key: new.get(key) for key in POINT_KEYS},
        **_paired_entry(base, new),
        "by_category": by_category,
    }


def _compare_categories(base: dict, new: dict) -> dict[str, dict]:
    """Per category (when both runs recorded their requests' categories): both accepted
    lengths and the paired difference with its 95% half-width, over that category's
    prompts."""
    if "request_categories" not in base or "request_categories" not in new:
        return {}
    categories = sorted({c for c in new["request_categories"] if c is not None})
    return {c: _paired_entry(_category_part(base, c), _category_part(new, c)) for c in categories}


def _category_part(record: dict, category: str) -> dict:
    """`record` cut to the requests of one category (what `accepted_length_difference`
    reads)."""
    keep = [i for i, c in enumerate(record["request_categories"]) if c == category]
    return {
        "requests": [record["requests"][i] for i in keep],
        "request_prompts": [record["request_prompts"][i] for i in keep],
        "prompts_digest": record["prompts_digest"],
    }


def format_comparison(
    rows: list[dict], *, title: str = "accepted length (tokens per round), paired by prompt"
) -> str:
    """One line per shared point: both accepted lengths, the difference and its 95%
    interval's half-width; under it one line per category when the runs have them."""
    header = (
        f"{'tree / category':>18} {'temp':>6} {'batch':>5} {'prompts':>7} {'base':>7} "
        f"{'new':>7} {'new-base':>9} {'+-95%':>7}"
    )
    lines = [title, header, "-" * len(header)]
    for row in rows:
        point = f"{tree_label(row):>18} {row['temperature']:>6.2f} {row['batch_size']:>5}"
        lines.append(f"{point} {_comparison_cells(row)}")
        for category, entry in row["by_category"].items():
            lines.append(f"{category:>18} {'':>6} {'':>5} {_comparison_cells(entry)}")
    return "\n".join(lines)


def _comparison_cells(entry: dict) -> str:
    width = entry["difference_half_width"]
    return (
        f"{entry['num_prompts']:>7} {entry['base_accepted_length']:>7.3f} "
        f"{entry['accepted_length']:>7.3f} {entry['difference']:>+9.3f} "
        + (f"{width:>7.3f}" if width is not None else f"{'n/a':>7}")
    )


def run_compare(base_path: Path, new_path: Path) -> list[dict]:
    """`specrun eval --compare BASE NEW`: the table on stdout; the rows returned."""
    rows = compare_runs(read_records(base_path), read_records(new_path))
    print(format_comparison(rows))
    return rows
