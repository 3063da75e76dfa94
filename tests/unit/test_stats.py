"""The intervals Chat-E's reports give (chat_e.data.stats), against their textbook formulas."""

from __future__ import annotations

import math

import pytest

from chat_e.data.stats import mcnemar_p, paired_difference, share, share_of

Z95 = 1.959963984540054  # the normal distribution's 97.5 % quantile


def wilson(k: int, n: int) -> tuple[float, float]:
    """Wilson's score interval, written out (Wilson 1927)."""
    p = k / n
    centre = (p + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 / (1 + Z95**2 / n) * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n))
    return centre - half, centre + half


@pytest.mark.parametrize("k, n", [(3, 4), (0, 10), (10, 10), (57, 100)])
def test_a_share_has_wilsons_interval(k, n):
    got = share(k, n)
    low, high = wilson(k, n)
    assert (got.k, got.n, got.rate) == (k, n, k / n)
    assert got.low == pytest.approx(low, abs=1e-9) and got.high == pytest.approx(high, abs=1e-9)


def test_a_share_of_nothing_has_no_rate_and_a_bad_count_is_refused():
    assert share(0, 0).rate is None and share(0, 0).text() == "— (0 rows)"
    assert share_of([True, False, True, True]) == share(3, 4)
    assert share(3, 4).text() == "75.0% [30.1%, 95.4%] (3/4)"
    with pytest.raises(ValueError, match="0 <= k <= n"):
        share(5, 4)


def test_a_paired_difference_of_pass_fail_scores():
    old, new = [0, 0, 1, 1, 0, 1], [1, 1, 1, 0, 0, 1]
    d = paired_difference(old, new, seed=3)
    assert (d.n, d.old, d.new) == (6, 0.5, 4 / 6)
    assert d.diff == pytest.approx(1 / 6) and d.low <= d.diff <= d.high and not d.excludes_zero()
    # McNemar: 2 items gained, 1 lost; the exact two-sided binomial p of 2 of 3 is 1
    assert d.p_value == pytest.approx(1.0) and mcnemar_p([True] * 3, [True] * 3) == 1.0
    assert paired_difference(old, new, seed=3) == d  # seeded


def test_a_paired_difference_that_excludes_zero_and_one_of_continuous_scores():
    old, new = [0] * 30, [1] * 30
    d = paired_difference(old, new)
    assert d.diff == d.low == d.high == 1.0 and d.excludes_zero()
    assert d.p_value == pytest.approx(2 * 0.5**30)  # 30 discordant items, all one way
    nll = paired_difference([2.0, 3.0, 4.0], [1.5, 2.5, 3.0])
    assert nll.p_value is None and nll.diff == pytest.approx(-2 / 3) and nll.high < 0
    with pytest.raises(ValueError, match="one length"):
        paired_difference([1, 2], [1])
