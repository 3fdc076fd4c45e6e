"""Goodness-of-fit without SciPy: Pearson's chi-square and its upper-tail p-value."""

from __future__ import annotations

import math


def chi_square_p_value(
    counts: dict, probabilities: dict, num_samples: int, *, min_expected: float = 5.0
) -> float:
    """p-value of observed counts under the given probabilities.

    Cells with expected count below `min_expected` are pooled into one, as the test requires.
    """
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0.0, 0.0
    for key, p in probabilities.items():
        expected = p * num_samples
        if expected < min_expected:
            pooled_obs += counts.get(key, 0)
            pooled_exp += expected
            continue
        stat += (counts.get(key, 0) - expected) ** 2 / expected
        dof += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-12)
        dof += 1
    unknown = set(counts) - set(probabilities)
    if any(counts[k] for k in unknown):
        return 0.0
    return _chi_square_sf(stat, max(dof, 1))


def _chi_square_sf(x: float, dof: int) -> float:
    """Upper tail of the chi-square distribution: Q(dof/2, x/2), by series / continued fraction."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    if z < a + 1:
        term = total = 1.0 / a
        n = a
        for _ in range(1000):
            n += 1
            term *= z / n
            total += term
            if term < total * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - math.lgamma(a)))
    b, c, d = z + 1 - a, 1e300, 1 / (z + 1 - a)
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1 / (d if abs(d) > 1e-300 else 1e-300)
        c = b + an / c if abs(c) > 1e-300 else 1e-300
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(-z + a * math.log(z) - math.lgamma(a)) * h
