"""The statistics of Chat-E's blind arena: who wins, by how much, and how sure that is. Pure functions, no Gradio.

A vote is ``(model_a, model_b, winner)`` -- model A shown on the left -- with ``winner`` one of FastChat's vote
kinds: ``model_a``, ``model_b``, ``tie`` or ``bothbad`` (a mapping with those keys, as the arena records it, is
read too). Two views:

* two models (:func:`two_model_summary`): the win rate of one over the other among the decisive votes (ties and
  both-bad left out), its 95 % confidence interval and p-value against a coin (scipy's exact binomial test), and how
  many decisive votes it takes to tell a 55 % or a 60 % preference from a coin (:func:`votes_needed`);
* three or more models (:func:`bradley_terry`): Bradley-Terry strengths fitted by ``choix`` on an Elo-like scale,
  with bootstrap 95 % intervals.

:func:`leaderboard` picks the view by the number of models; :func:`win_matrix` and :func:`plot_win_matrix` give
every pair's head-to-head record and its heatmap.
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import choix
import numpy as np
from scipy import stats

from hf_ext.atomic import write_bytes_atomically

from ..data.stats import CONFIDENCE, SHARE_METHOD, share
from .store import WINNERS

#: the vote kinds (:data:`chat_e.feedback.store.WINNERS`, FastChat's) that have a winner
DECISIVE = ("model_a", "model_b")
#: the confidence interval of a win rate: a share's (chat_e.data.stats: Wilson's score interval)
CI_METHOD = SHARE_METHOD
#: the preferences (win rates) :func:`votes_needed` sizes a two-model comparison for
PREFERENCES = (0.55, 0.60)
ALPHA = 0.05  # two-sided significance level of the test against a coin
POWER = 0.8
#: choix's regularization: ``alpha`` virtual comparisons between every pair of models, so that the estimate exists
#: when a model never loses (or never plays) -- small beside one vote, which weighs 2 (see :func:`comparisons`)
BT_ALPHA = 0.01
BT_MAX_ITER = 10_000
BT_TOL = 1e-10  # I-LSR stops when an iteration moves the strengths less than this (L1)
#: the Elo-like scale: ``score = ELO_BASE + ELO_SCALE / ln(10) * (theta - mean(theta))`` for choix's natural-log
#: strengths ``theta``, so that a difference of 400 points means 10:1 odds of winning, as in chess ratings and
#: FastChat's leaderboard (whose scores are anchored differently: only differences compare)
ELO_BASE = 1000.0
ELO_SCALE = 400.0
BOOTSTRAP_ROUNDS = 200

Vote = tuple[str, str, str]


def as_vote(vote: Any) -> Vote:
    """``(model_a, model_b, winner)`` of a vote given as that tuple or as a mapping with those keys; a vote whose
    winner is not one of :data:`WINNERS`, or whose two sides are one model, is a ``ValueError``."""
    if isinstance(vote, Mapping):
        vote = (vote["model_a"], vote["model_b"], vote["winner"])
    model_a, model_b, winner = vote
    if winner not in WINNERS:
        raise ValueError(f"A vote's winner is one of {', '.join(WINNERS)}, not {winner!r}.")
    if model_a == model_b:
        raise ValueError(f"A vote compares two different models, not {model_a!r} with itself.")
    return str(model_a), str(model_b), winner


def models_of(votes: Iterable[Any], models: Iterable[str] = ()) -> list[str]:
    """``models`` and every model the votes name, each once, in order of first appearance."""
    found = dict.fromkeys(models)
    for model_a, model_b, _ in map(as_vote, votes):
        found.setdefault(model_a)
        found.setdefault(model_b)
    return list(found)


# ---- two models ---------------------------------------------------------------------------------------------------


@dataclass
class Needed:
    """Decisive votes that tell a ``preference`` (a win rate) from a coin: ``total`` in all, ``missing`` of them not
    cast yet."""

    preference: float
    total: int
    missing: int


@dataclass
class TwoModelSummary:
    """``model`` against ``other``: wins, losses, ties and both-bad votes; the win rate among the decisive votes,
    its :data:`CONFIDENCE` interval (:data:`CI_METHOD`) and the p-value of scipy's exact two-sided binomial test
    against a coin (None without decisive votes); the decisive votes needed to tell each of :data:`PREFERENCES` from
    a coin."""

    model: str
    other: str
    wins: int
    losses: int
    ties: int
    bothbad: int
    win_rate: float | None
    ci: tuple[float, float] | None
    p_value: float | None
    needed: list[Needed]

    @property
    def decisive(self) -> int:
        return self.wins + self.losses

    def text(self) -> str:
        """The summary in a few Markdown lines."""
        lines = [
            f"**{self.model}** against **{self.other}**: {self.wins} wins, {self.losses} losses, {self.ties} ties, "
            f"{self.bothbad} both bad."
        ]
        if self.win_rate is None:
            lines.append("No decisive vote yet (ties and both-bad votes do not count towards the win rate).")
        else:
            low, high = self.ci
            lines.append(
                f"Win rate {self.win_rate:.1%} of {self.decisive} decisive votes, {CONFIDENCE:.0%} CI "
                f"{low:.1%} to {high:.1%} ({CI_METHOD}); p = {self.p_value:.3g} against a coin (exact binomial test)."
            )
        for need in self.needed:
            still = f"{need.missing} more" if need.missing else "reached"
            lines.append(
                f"To tell a {need.preference:.0%} preference from a coin ({POWER:.0%} power, two-sided "
                f"alpha {ALPHA}): {need.total} decisive votes ({still})."
            )
        return "  \n".join(lines)


def votes_needed(preference: float, alpha: float = ALPHA, power: float = POWER) -> int:
    """Decisive votes for a two-sided test of a coin (win rate 0.5) at level ``alpha`` to detect a true win rate of
    ``preference`` with probability ``power``: the one-sample proportion formula

        n = ((z[1 - alpha/2] sqrt(p0 (1 - p0)) + z[power] sqrt(p1 (1 - p1))) / (p1 - p0)) ** 2,

    rounded up, with p0 = 0.5, p1 = ``preference`` and z scipy's normal quantiles."""
    if not 0 < preference < 1 or preference == 0.5:
        raise ValueError(f"A preference is a win rate in (0, 1) other than 0.5, not {preference}.")
    p0, p1 = 0.5, preference
    z_alpha, z_power = stats.norm.ppf(1 - alpha / 2), stats.norm.ppf(power)
    n = ((z_alpha * math.sqrt(p0 * (1 - p0)) + z_power * math.sqrt(p1 * (1 - p1))) / (p1 - p0)) ** 2
    return math.ceil(n - 1e-9)  # a float a hair above an integer still needs only that integer


def two_model_summary(votes: Iterable[Any], model: str, other: str) -> TwoModelSummary:
    """``model``'s record against ``other`` (whichever side each was on); votes between other models are ignored."""
    wins = losses = ties = bothbad = 0
    for model_a, model_b, winner in map(as_vote, votes):
        if {model_a, model_b} != {model, other}:
            continue
        if winner == "tie":
            ties += 1
        elif winner == "bothbad":
            bothbad += 1
        elif (winner == "model_a") == (model_a == model):
            wins += 1
        else:
            losses += 1
    decisive = wins + losses
    win_rate = ci = p_value = None
    if decisive:
        rate = share(wins, decisive)
        win_rate, ci, p_value = rate.rate, (rate.low, rate.high), float(stats.binomtest(wins, decisive, 0.5).pvalue)
    needed = [Needed(p, votes_needed(p), max(0, votes_needed(p) - decisive)) for p in PREFERENCES]
    return TwoModelSummary(model, other, wins, losses, ties, bothbad, win_rate, ci, p_value, needed)


# ---- Bradley-Terry ------------------------------------------------------------------------------------------------


def comparisons(votes: Iterable[Any], models: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Each vote as two ``(winner index, loser index)`` comparisons, weighted as FastChat's maximum-likelihood Elo
    weighs votes: a decisive vote is its ``(winner, loser)`` twice, a tie or a both-bad vote ``(a, b)`` and
    ``(b, a)`` -- half a win for each side. Returns ``(winners, losers)``, two ``(votes, 2)`` index arrays."""
    index = {m: i for i, m in enumerate(models)}
    winners, losers = [], []
    for model_a, model_b, winner in map(as_vote, votes):
        a, b = index[model_a], index[model_b]
        if winner == "model_a":
            winners.append((a, a))
            losers.append((b, b))
        elif winner == "model_b":
            winners.append((b, b))
            losers.append((a, a))
        else:
            winners.append((a, b))
            losers.append((b, a))
    return np.array(winners, dtype=int).reshape(-1, 2), np.array(losers, dtype=int).reshape(-1, 2)


def comparison_matrix(winners: np.ndarray, losers: np.ndarray, n_models: int) -> np.ndarray:
    """choix's dense pairwise data from :func:`comparisons`' arrays: ``[i, j]`` counts the comparisons ``i`` won
    against ``j``."""
    matrix = np.zeros((n_models, n_models))
    np.add.at(matrix, (winners.ravel(), losers.ravel()), 1.0)
    return matrix


def elo_scale(theta: np.ndarray) -> np.ndarray:
    """choix's natural-log strengths on the Elo-like scale (:data:`ELO_SCALE` points for 10:1 odds, mean
    :data:`ELO_BASE`)."""
    theta = np.asarray(theta, dtype=float)
    return ELO_BASE + ELO_SCALE / math.log(10) * (theta - theta.mean())


def bt_fit(matrix: np.ndarray) -> np.ndarray:
    """choix's Bradley-Terry strengths (natural log, mean 0) from a :func:`comparison_matrix`: I-LSR's maximum
    likelihood (``choix.ilsr_pairwise_dense``: the same estimate as ``choix.ilsr_pairwise`` on the comparisons as a
    list, at a cost that does not grow with the number of votes), regularized by :data:`BT_ALPHA`."""
    return choix.ilsr_pairwise_dense(matrix, alpha=BT_ALPHA, max_iter=BT_MAX_ITER, tol=BT_TOL)


@dataclass
class BTRow:
    """One model's Bradley-Terry score on the Elo-like scale, its bootstrap interval, and its votes."""

    model: str
    score: float
    low: float
    high: float
    votes: int
    wins: int
    losses: int
    ties: int


def bradley_terry(
    votes: Sequence[Any],
    models: Sequence[str] | None = None,
    rounds: int = BOOTSTRAP_ROUNDS,
    seed: int | None = 0,
) -> list[BTRow]:
    """Every model's Bradley-Terry score (:func:`bt_fit` on :func:`elo_scale`), best first, with a
    :data:`CONFIDENCE` percentile interval from ``rounds`` bootstrap resamples of the votes (drawn with replacement
    by a numpy Generator seeded with ``seed``; each resample refitted by choix). ``models``: those to rank (default:
    the ones the votes name); a model without votes scores :data:`ELO_BASE` plus what the others' results move it."""
    votes = [as_vote(v) for v in votes]
    models = models_of(votes, models or ())
    if not models:
        return []
    winners, losers = comparisons(votes, models)
    scores = elo_scale(bt_fit(comparison_matrix(winners, losers, len(models))))
    if votes and rounds:
        rng = np.random.default_rng(seed)
        samples = np.empty((rounds, len(models)))
        for r in range(rounds):
            picked = rng.integers(0, len(votes), size=len(votes))  # votes drawn with replacement
            samples[r] = elo_scale(bt_fit(comparison_matrix(winners[picked], losers[picked], len(models))))
        tail = (1 - CONFIDENCE) / 2 * 100
        lows, highs = np.percentile(samples, [tail, 100 - tail], axis=0)
    else:
        lows, highs = np.full(len(models), np.nan), np.full(len(models), np.nan)
    counts = {m: [0, 0, 0, 0] for m in models}  # votes, wins, losses, ties (both-bad included)
    for model_a, model_b, winner in votes:
        for side, model in (("model_a", model_a), ("model_b", model_b)):
            counts[model][0] += 1
            if winner in DECISIVE:
                counts[model][1 if winner == side else 2] += 1
            else:
                counts[model][3] += 1
    rows = [BTRow(m, float(scores[i]), float(lows[i]), float(highs[i]), *counts[m]) for i, m in enumerate(models)]
    return sorted(rows, key=lambda row: -row.score)


# ---- the pairwise win-rate matrix ---------------------------------------------------------------------------------


@dataclass
class WinMatrix:
    """``wins[i][j]``: decisive votes where ``models[i]`` beat ``models[j]`` (on either side); ``ties[i][j]``: tie
    and both-bad votes between them (symmetric)."""

    models: list[str]
    wins: list[list[int]]
    ties: list[list[int]]

    def decisive(self, i: int, j: int) -> int:
        return self.wins[i][j] + self.wins[j][i]

    def rate(self, i: int, j: int) -> float | None:
        """``models[i]``'s win rate against ``models[j]`` among their decisive votes (None without any)."""
        n = self.decisive(i, j)
        return self.wins[i][j] / n if n else None


def win_matrix(votes: Iterable[Any], models: Sequence[str] = ()) -> WinMatrix:
    """Every pair's head-to-head record (:class:`WinMatrix`) over ``models`` and the models the votes name."""
    votes = [as_vote(v) for v in votes]
    models = models_of(votes, models)
    index = {m: i for i, m in enumerate(models)}
    n = len(models)
    wins = [[0] * n for _ in range(n)]
    ties = [[0] * n for _ in range(n)]
    for model_a, model_b, winner in votes:
        a, b = index[model_a], index[model_b]
        if winner == "model_a":
            wins[a][b] += 1
        elif winner == "model_b":
            wins[b][a] += 1
        else:
            ties[a][b] += 1
            ties[b][a] += 1
    return WinMatrix(models, wins, ties)


def matrix_figsize(n_models: int) -> tuple[float, float]:
    """The win-rate heatmap's size in inches for ``n_models`` (its PNG is this times the dpi, in pixels)."""
    side = 1.6 + 1.1 * max(n_models, 1)
    return side + 1.4, side


def plot_win_matrix(matrix: WinMatrix, path: str | Path, dpi: int = 100) -> Path:
    """The win-rate matrix as a PNG heatmap (headless matplotlib): row model's win rate against the column model,
    each cell annotated with the rate and ``wins/decisive votes``; a pair without decisive votes is left grey."""
    import matplotlib  # noqa: PLC0415 (optional extra: chat)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (optional extra: chat)

    n = len(matrix.models)
    rates = np.array(
        [[np.nan if (r := matrix.rate(i, j)) is None else r for j in range(n)] for i in range(n)], dtype=float
    ).reshape(n, n)
    fig, ax = plt.subplots(figsize=matrix_figsize(n), dpi=dpi)
    cmap = matplotlib.colormaps["RdBu"].with_extremes(bad="#dddddd")
    image = ax.imshow(np.ma.masked_invalid(rates), cmap=cmap, vmin=0.0, vmax=1.0)
    for i in range(n):
        for j in range(n):
            rate = matrix.rate(i, j)
            label = (
                "" if i == j else "–" if rate is None else f"{rate:.2f}\n{matrix.wins[i][j]}/{matrix.decisive(i, j)}"
            )
            dark = rate is not None and abs(rate - 0.5) > 0.3
            ax.text(j, i, label, ha="center", va="center", fontsize=9, color="white" if dark else "black")
    names = [_short(m) for m in matrix.models]
    ax.set_xticks(range(n), names, rotation=30, ha="right")
    ax.set_yticks(range(n), names)
    ax.set_xlabel("opponent")
    ax.set_ylabel("model")
    ax.set_title("win rate among decisive votes")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=dpi)
    plt.close(fig)
    path = Path(path)
    write_bytes_atomically(path, png.getvalue())
    return path


def _short(name: str, limit: int = 24) -> str:
    return name if len(name) <= limit else "…" + name[-(limit - 1) :]


# ---- the leaderboard ----------------------------------------------------------------------------------------------


@dataclass
class Leaderboard:
    """What the arena's leaderboard shows: a table (``headers`` and ``rows``, as a ``gr.Dataframe`` takes them), a
    Markdown ``text``, and the pairwise :class:`WinMatrix`. ``view`` is ``two-model``, ``bradley-terry`` or ``none``
    (fewer than two models); ``summary`` / ``ranking`` hold the view's numbers."""

    view: str
    headers: list[str]
    rows: list[list[Any]]
    text: str
    matrix: WinMatrix
    summary: TwoModelSummary | None = None
    ranking: list[BTRow] = field(default_factory=list)

    def value(self) -> dict[str, Any]:
        """The table as a ``gr.Dataframe`` value."""
        return {"headers": self.headers, "data": self.rows}


TWO_MODEL_HEADERS = ["model", "wins", "losses", "ties", "both bad", "win rate", "CI low", "CI high"]
BT_HEADERS = ["rank", "model", "score", "CI low", "CI high", "votes", "wins", "losses", "ties"]


def leaderboard(
    votes: Iterable[Any], models: Sequence[str] = (), rounds: int = BOOTSTRAP_ROUNDS, seed: int | None = 0
) -> Leaderboard:
    """The leaderboard of ``models`` and every model the votes name: the two-model view for two of them, the
    Bradley-Terry view for three or more (scores rounded to 0.1 point, rates to 0.001)."""
    votes = [as_vote(v) for v in votes]
    models = models_of(votes, models)
    matrix = win_matrix(votes, models)
    if len(models) < 2:
        return Leaderboard("none", TWO_MODEL_HEADERS, [], "The arena needs at least two models.", matrix)
    if len(models) == 2:
        first = two_model_summary(votes, models[0], models[1])
        second = two_model_summary(votes, models[1], models[0])
        rows = [_two_model_row(s) for s in (first, second)]
        return Leaderboard("two-model", TWO_MODEL_HEADERS, rows, first.text(), matrix, summary=first)
    ranking = bradley_terry(votes, models, rounds=rounds, seed=seed)
    rows = [
        [rank, r.model, round(r.score, 1), _round(r.low, 1), _round(r.high, 1), r.votes, r.wins, r.losses, r.ties]
        for rank, r in enumerate(ranking, 1)
    ]
    text = (
        f"Bradley-Terry scores of {len(models)} models from {len(votes)} votes (fitted by choix; ties and both-bad "
        f"votes count as half a win each way). {ELO_SCALE:.0f} points mean 10:1 odds of winning; the mean is "
        f"{ELO_BASE:.0f}. {CONFIDENCE:.0%} intervals from {rounds} bootstrap resamples of the votes."
    )
    return Leaderboard("bradley-terry", BT_HEADERS, rows, text, matrix, ranking=ranking)


def _two_model_row(s: TwoModelSummary) -> list[Any]:
    low, high = s.ci or (None, None)
    return [s.model, s.wins, s.losses, s.ties, s.bothbad, _round(s.win_rate, 3), _round(low, 3), _round(high, 3)]


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, digits)


#: the newest win-matrix PNGs kept in the arena's plot directory (older ones are deleted as new ones are written)
KEPT_PLOTS = 16


def matrix_png(matrix: WinMatrix, directory: str | Path, dpi: int = 100) -> Path:
    """:func:`plot_win_matrix` into ``directory``, named after the matrix's content (one file per distinct matrix,
    so a refresh that changed nothing writes nothing new and concurrent refreshes never write one file twice). The
    directory keeps the newest :data:`KEPT_PLOTS` of them (a page still showing an older one has its own copy in
    Gradio's cache)."""
    key = repr((matrix.models, matrix.wins, matrix.ties, dpi)).encode()
    path = Path(directory) / f"win-matrix-{hashlib.sha256(key).hexdigest()[:16]}.png"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        plot_win_matrix(matrix, path, dpi=dpi)
        older = sorted(path.parent.glob("win-matrix-*.png"), key=_mtime, reverse=True)[KEPT_PLOTS:]
        for stale in older:
            stale.unlink(missing_ok=True)
    return path


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # deleted meanwhile by a concurrent refresh
        return 0.0
