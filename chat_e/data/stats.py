"""How sure a measured share or difference is: the intervals every Chat-E report gives beside its numbers.

* :func:`share`: ``k`` of ``n`` with Wilson's 95 % score interval (scipy). With the few rows a chat app's feedback
  holds it keeps close to its nominal coverage (Brown, Cai & DasGupta 2001), where Clopper-Pearson's "exact"
  interval is wider than it needs to be, and unlike the Wald interval it never shrinks to a point at 0 or ``n``.
* :func:`paired_difference`: two models scored on the same items (a prompt followed or not, a reply's NLL): the mean
  difference, its 95 % percentile interval from a seeded paired bootstrap (the items resampled, both models' scores
  kept together), and for 0/1 scores McNemar's exact test (a binomial test of the discordant items).

Pure functions: numpy and scipy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
#: the interval of a share (scipy's ``BinomTestResult.proportion_ci`` method)
SHARE_METHOD = "wilson"
BOOTSTRAP_ROUNDS = 2000


@dataclass(frozen=True)
class Share:
    """``k`` of ``n`` items, the share ``k / n`` (None when ``n`` is 0) and its :data:`CONFIDENCE` interval."""

    k: int
    n: int
    rate: float | None
    low: float | None
    high: float | None

    def text(self) -> str:
        """``75.0 % [30.1, 95.4] (3/4)``, or ``— (0 rows)``."""
        if self.rate is None:
            return "— (0 rows)"
        return f"{self.rate:.1%} [{self.low:.1%}, {self.high:.1%}] ({self.k}/{self.n})"

    def as_dict(self) -> dict:
        return asdict(self)


def share(k: int, n: int) -> Share:
    """``k`` of ``n`` with Wilson's :data:`CONFIDENCE` interval."""
    k, n = int(k), int(n)
    if not 0 <= k <= n:
        raise ValueError(f"A share is k of n with 0 <= k <= n, not {k} of {n}.")
    if n == 0:
        return Share(0, 0, None, None, None)
    ci = stats.binomtest(k, n, 0.5).proportion_ci(confidence_level=CONFIDENCE, method=SHARE_METHOD)
    return Share(k, n, k / n, float(ci.low), float(ci.high))


def share_of(flags: Sequence[bool]) -> Share:
    """The share of true ``flags``."""
    return share(sum(bool(f) for f in flags), len(flags))


@dataclass(frozen=True)
class Difference:
    """``new - old`` over ``n`` paired items: the mean difference, its :data:`CONFIDENCE` interval (paired
    bootstrap), and for 0/1 scores McNemar's exact p-value (None otherwise)."""

    n: int
    old: float | None
    new: float | None
    diff: float | None
    low: float | None
    high: float | None
    p_value: float | None = None

    def excludes_zero(self) -> bool:
        """Whether the interval lies wholly on one side of no change."""
        return self.low is not None and (self.low > 0 or self.high < 0)

    def as_dict(self) -> dict:
        return asdict(self)


def mcnemar_p(old: Sequence[bool], new: Sequence[bool]) -> float:
    """McNemar's exact two-sided p-value: of the items on which the two disagree, do as many go each way as a coin
    would say (1.0 when they never disagree)."""
    gained = sum(1 for a, b in zip(old, new, strict=True) if b and not a)
    lost = sum(1 for a, b in zip(old, new, strict=True) if a and not b)
    if gained + lost == 0:
        return 1.0
    return float(stats.binomtest(gained, gained + lost, 0.5).pvalue)


def paired_difference(
    old: Sequence[float], new: Sequence[float], rounds: int = BOOTSTRAP_ROUNDS, seed: int = 0
) -> Difference:
    """The mean of ``new - old`` over paired items, with a seeded paired-bootstrap percentile interval; McNemar's
    exact p-value too when every score is 0 or 1."""
    a, b = np.asarray(old, dtype=float), np.asarray(new, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"Paired scores need two lists of one length, not {a.shape} and {b.shape}.")
    n = len(a)
    if n == 0:
        return Difference(0, None, None, None, None, None)
    d = b - a
    idx = np.random.default_rng(seed).integers(0, n, size=(rounds, n))
    means = d[idx].mean(axis=1)
    tail = (1 - CONFIDENCE) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    binary = bool(np.isin(a, (0.0, 1.0)).all() and np.isin(b, (0.0, 1.0)).all())
    p = mcnemar_p(a.astype(bool), b.astype(bool)) if binary else None
    return Difference(n, float(a.mean()), float(b.mean()), float(d.mean()), float(low), float(high), p)
