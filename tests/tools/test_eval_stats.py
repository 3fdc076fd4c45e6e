"""tools/eval_stats.py: the accepted length's standard error over prompts and the paired
comparison of two `specrun eval` runs, against the closed form and a bootstrap
(`specrun eval --compare` end to end: tests/tools/test_eval.py)."""

from __future__ import annotations

import math
import random

import pytest

from specrun.tools.eval_stats import (
    Z95,
    accepted_length,
    accepted_length_difference,
    against_first_side,
    compare_runs,
    format_comparison,
    prompts_digest,
)


def _random_requests(rng: random.Random, num_prompts: int) -> list[list[int]]:
    """(rounds, accepted drafts) per prompt, prompts of very different acceptance."""
    requests = []
    for _ in range(num_prompts):
        rounds = rng.randint(20, 120)
        per_round = rng.uniform(0.5, 4.0)
        requests.append([rounds, int(rounds * per_round)])
    return requests


def _ratio_stderr_reference(rounds: list[int], tokens: list[int]) -> float:
    """The ratio estimator's delta-method standard error from the sample (co)variances:
    sqrt((s_t^2 - 2 L s_tr + L^2 s_r^2) / n) / mean rounds."""
    n = len(rounds)
    ratio = sum(tokens) / sum(rounds)
    mean_r, mean_t = sum(rounds) / n, sum(tokens) / n
    var_r = sum((r - mean_r) ** 2 for r in rounds) / (n - 1)
    var_t = sum((t - mean_t) ** 2 for t in tokens) / (n - 1)
    cov = sum((r - mean_r) * (t - mean_t) for r, t in zip(rounds, tokens, strict=True)) / (n - 1)
    return math.sqrt((var_t - 2 * ratio * cov + ratio**2 * var_r) / n) / mean_r


def test_accepted_length_matches_the_ratio_estimators_variance():
    requests = _random_requests(random.Random(0), 37)
    estimate = accepted_length(requests, list(range(37)))
    rounds = [r for r, _ in requests]
    tokens = [r + a for r, a in requests]
    assert estimate.value == pytest.approx(sum(tokens) / sum(rounds))
    assert estimate.stderr == pytest.approx(_ratio_stderr_reference(rounds, tokens))
    assert estimate.half_width == pytest.approx(Z95 * estimate.stderr)
    assert estimate.num_prompts == 37


def test_accepted_length_stderr_agrees_with_a_bootstrap_over_prompts():
    rng = random.Random(1)
    requests = _random_requests(rng, 300)
    estimate = accepted_length(requests, list(range(300)))
    draws = []
    for _ in range(1500):
        sample = [requests[rng.randrange(300)] for _ in range(300)]
        draws.append(sum(r + a for r, a in sample) / sum(r for r, _ in sample))
    mean = sum(draws) / len(draws)
    bootstrap = math.sqrt(sum((d - mean) ** 2 for d in draws) / (len(draws) - 1))
    assert estimate.stderr == pytest.approx(bootstrap, rel=0.1)


def test_requests_of_one_prompt_count_as_one():
    """Repeats of a prompt (greedy: the same rounds) add no information: the error is that
    of the prompts once, not sqrt(2) smaller as independent requests would make it."""
    requests = _random_requests(random.Random(2), 12)
    once = accepted_length(requests, list(range(12)))
    twice = accepted_length(requests * 2, list(range(12)) * 2)
    as_independent = accepted_length(requests * 2, list(range(24)))
    assert twice.value == pytest.approx(once.value)
    assert twice.stderr == pytest.approx(once.stderr)
    assert twice.num_prompts == 12
    assert as_independent.stderr < 0.8 * once.stderr
    assert accepted_length(requests[:1], [0]).stderr is None


def _record(requests: list[list[int]], digest: str = "d", **point) -> dict:
    rounds = sum(r for r, _ in requests)
    return {
        "policy": "fixed", "depth": 6, "topk": 8, "nodes": 40, "stochastic": True,
        "temperature": 0.0, "batch_size": 1, **point,
        "mean_accepted_length": sum(r + a for r, a in requests) / rounds,
        "requests": requests, "request_prompts": list(range(len(requests))),
        "prompts_digest": digest,
    }  # fmt: skip


def test_paired_difference_is_tighter_than_either_run_when_prompts_dominate():
    """A head better on every prompt by a little: the difference is the ratios' difference,
    and its paired error far below each run's own (the prompts' spread cancels); against a
    bootstrap that resamples prompts for both runs together."""
    rng = random.Random(3)
    base = _random_requests(rng, 200)
    new = [[r, a + int(0.05 * r) + rng.randint(0, 3)] for r, a in base]
    difference = accepted_length_difference(_record(base), _record(new))
    base_estimate = accepted_length(base, list(range(200)))
    new_estimate = accepted_length(new, list(range(200)))
    assert difference.value == pytest.approx(new_estimate.value - base_estimate.value)
    assert difference.stderr < 0.2 * min(base_estimate.stderr, new_estimate.stderr)
    draws = []
    for _ in range(1500):
        picks = [rng.randrange(200) for _ in range(200)]
        ratios = [
            sum(run[i][0] + run[i][1] for i in picks) / sum(run[i][0] for i in picks)
            for run in (base, new)
        ]
        draws.append(ratios[1] - ratios[0])
    mean = sum(draws) / len(draws)
    bootstrap = math.sqrt(sum((d - mean) ** 2 for d in draws) / (len(draws) - 1))
    assert difference.stderr == pytest.approx(bootstrap, rel=0.12)
    same = accepted_length_difference(_record(base), _record(base))
    assert (same.value, same.stderr) == (0.0, 0.0)


def test_one_runs_sides_pair_with_its_first_side_at_each_point():
    """Three trees at two temperatures in one run: each later tree against the first at the
    same point, the difference `accepted_length_difference` gives; nothing for the first."""
    rng = random.Random(5)
    runs = {}
    for nodes in (40, 48, 56):
        for temperature in (0.0, 1.0):
            runs[nodes, temperature] = _record(
                _random_requests(rng, 30), nodes=nodes, temperature=temperature
            )
    records = list(runs.values())
    rows = against_first_side(records)
    assert [(r["nodes"], r["temperature"]) for r in rows] == [
        (48, 0.0), (48, 1.0), (56, 0.0), (56, 1.0)
    ]  # fmt: skip
    for row in rows:
        base, new = runs[40, row["temperature"]], runs[row["nodes"], row["temperature"]]
        assert row["difference"] == pytest.approx(accepted_length_difference(base, new).value)
        assert row["base_accepted_length"] == pytest.approx(base["mean_accepted_length"])
    assert against_first_side(records[:2]) == []  # one side at each temperature
    text = format_comparison(rows, title="against 6,8,40")
    assert text.splitlines()[0] == "against 6,8,40" and len(text.splitlines()) == 3 + 4


def test_compare_refuses_runs_it_cannot_pair():
    requests = _random_requests(random.Random(4), 5)
    with pytest.raises(ValueError, match="decoded different prompts"):
        compare_runs([_record(requests, "a")], [_record(requests, "b")])
    with pytest.raises(ValueError, match="share no point"):
        compare_runs([_record(requests)], [_record(requests, temperature=1.0)])
    old = {k: v for k, v in _record(requests).items() if k != "request_prompts"}
    with pytest.raises(ValueError, match="rerun it with this version"):
        compare_runs([old], [_record(requests)])
    fewer = _record(requests[:4])
    with pytest.raises(ValueError, match="different sets of prompts"):
        compare_runs([fewer], [_record(requests)])


def test_prompts_digest_depends_on_the_prompts_and_their_order():
    assert prompts_digest(["a", [1, 2]]) == prompts_digest(["a", (1, 2)])
    assert prompts_digest(["a", "b"]) != prompts_digest(["b", "a"])


def test_compare_pairs_each_category_over_its_own_prompts():
    """A head better only on "a" prompts: category a's difference is all of it, b's is
    zero with no error, and each equals the paired difference over that category alone."""
    rng = random.Random(5)
    base = _random_requests(rng, 40)
    categories = ["a", "b"] * 20
    new = [[r, a + (r // 4 if c == "a" else 0)] for (r, a), c in zip(base, categories, strict=True)]
    base_record = {**_record(base), "request_categories": categories}
    new_record = {**_record(new), "request_categories": categories}
    [row] = compare_runs([base_record], [new_record])
    assert sorted(row["by_category"]) == ["a", "b"]
    a, b = row["by_category"]["a"], row["by_category"]["b"]
    only_a = accepted_length_difference(
        _record([base[i] for i in range(0, 40, 2)]), _record([new[i] for i in range(0, 40, 2)])
    )
    assert a["difference"] == pytest.approx(only_a.value) and a["difference"] > 0.2
    assert a["difference_half_width"] == pytest.approx(only_a.half_width)
    assert (b["difference"], b["difference_half_width"], b["num_prompts"]) == (0.0, 0.0, 20)
    assert a["base_accepted_length"] == pytest.approx(
        accepted_length([base[i] for i in range(0, 40, 2)], list(range(20))).value
    )
    assert compare_runs([_record(base)], [_record(new)])[0]["by_category"] == {}
    table = format_comparison([row]).splitlines()
    assert [line.split()[0] for line in table[3:]] == ["6,8,40,s", "a", "b"]
