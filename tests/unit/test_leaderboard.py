"""The arena's statistics (chat_e.feedback.leaderboard) against independent oracles: choix and scipy called here on data
encoded by hand, a Monte-Carlo power estimate, counts written out."""

from __future__ import annotations

import math
import struct

import choix
import numpy as np
import pytest
from scipy import stats

from chat_e.feedback.leaderboard import (
    BT_ALPHA,
    BT_HEADERS,
    ELO_BASE,
    TWO_MODEL_HEADERS,
    bradley_terry,
    leaderboard,
    matrix_figsize,
    matrix_png,
    plot_win_matrix,
    two_model_summary,
    votes_needed,
    win_matrix,
)

#: x, y, z: x beats y 5 times (3 of them on the left), loses to it twice, one tie and one both-bad; x beats z twice and
#: never loses to it (so z never beats x: regularization keeps the estimate finite); y and z: 1 win each, one tie
VOTES = [
    ("x", "y", "model_a"),
    ("x", "y", "model_a"),
    ("x", "y", "model_a"),
    ("y", "x", "model_b"),
    ("y", "x", "model_b"),
    ("y", "x", "model_a"),
    ("x", "y", "model_b"),
    ("x", "y", "tie"),
    ("y", "x", "bothbad"),
    ("x", "z", "model_a"),
    ("z", "x", "model_b"),
    ("y", "z", "model_a"),
    ("z", "y", "model_a"),
    ("z", "y", "tie"),
]
TWO = [v for v in VOTES if "z" not in v[:2]]


def test_two_model_win_rate_leaves_out_ties_and_both_bad():
    s = two_model_summary(TWO, "x", "y")
    # by hand: x won votes 1-3 (left) and 4-5 (right); y won 6 (left) and 7 (right); 8 is a tie, 9 both bad
    assert (s.wins, s.losses, s.ties, s.bothbad) == (5, 2, 1, 1)
    assert s.decisive == 7 and s.win_rate == pytest.approx(5 / 7)
    other = two_model_summary(TWO, "y", "x")
    assert (other.wins, other.losses) == (2, 5)
    # a tie or both-bad vote changes nothing of the rate
    more = two_model_summary([*TWO, ("x", "y", "tie"), ("y", "x", "bothbad")], "x", "y")
    assert (more.win_rate, more.ci, more.p_value) == (s.win_rate, s.ci, s.p_value)


def test_two_model_interval_and_p_value_are_scipys_on_the_hand_counted_wins():
    s = two_model_summary(TWO, "x", "y")
    test = stats.binomtest(5, 7, p=0.5)
    wilson = test.proportion_ci(confidence_level=0.95, method="wilson")
    assert s.ci == pytest.approx((wilson.low, wilson.high))
    assert s.p_value == pytest.approx(test.pvalue)
    # Wilson's interval written out (z = 1.96): an oracle that does not go through scipy's method name
    n, p, z = 7, 5 / 7, stats.norm.ppf(0.975)
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    assert s.ci == pytest.approx((centre - half, centre + half))


def test_no_decisive_vote_gives_no_rate():
    s = two_model_summary([("x", "y", "tie"), ("y", "x", "bothbad")], "x", "y")
    assert (s.win_rate, s.ci, s.p_value) == (None, None, None)
    assert "No decisive vote yet" in s.text()
    assert [n.missing for n in s.needed] == [n.total for n in s.needed]


def test_votes_needed_are_the_tabled_values():
    # the formula by hand with z(0.975) = 1.959964 and z(0.8) = 0.841621:
    # 55 %: ((0.979982 + 0.841621 * 0.497494) / 0.05)^2 = 782.5 -> 783
    # 60 %: ((0.979982 + 0.841621 * 0.489898) / 0.10)^2 = 193.8 -> 194
    assert votes_needed(0.55) == 783
    assert votes_needed(0.60) == 194
    assert votes_needed(0.45) == 783  # symmetric
    s = two_model_summary(TWO, "x", "y")
    assert [(n.preference, n.total, n.missing) for n in s.needed] == [(0.55, 783, 776), (0.60, 194, 187)]
    with pytest.raises(ValueError):
        votes_needed(0.5)


@pytest.mark.parametrize("preference", [0.55, 0.60])
def test_votes_needed_give_the_power_by_monte_carlo(preference):
    """At the computed n, a two-sided level-0.05 test of a coin rejects about 80 % of the time when the true win rate
    is ``preference`` (simulated with a seeded rng); at 3/4 of n it clearly does not."""
    rng = np.random.default_rng(1234)
    z = stats.norm.ppf(0.975)

    def power(n: int) -> float:
        wins = rng.binomial(n, preference, size=20_000)
        # the normal-approximation test the formula sizes: |wins/n - 0.5| / sqrt(0.25 / n) > z
        return float(np.mean(np.abs(wins / n - 0.5) / math.sqrt(0.25 / n) > z))

    n = votes_needed(preference)
    assert power(n) == pytest.approx(0.8, abs=0.02)
    assert power(int(0.75 * n)) < 0.72


def hand_encoded(votes, models):
    """choix's pairwise data for ``votes``, written here: a decisive vote is two (winner, loser) entries; a tie or a
    both-bad vote one entry each way."""
    index = {m: i for i, m in enumerate(models)}
    data = []
    for a, b, winner in votes:
        if winner == "model_a":
            data += [(index[a], index[b])] * 2
        elif winner == "model_b":
            data += [(index[b], index[a])] * 2
        else:
            data += [(index[a], index[b]), (index[b], index[a])]
    return data


def test_bradley_terry_scores_are_choixs():
    models = ["x", "y", "z"]
    theta = choix.ilsr_pairwise(3, hand_encoded(VOTES, models), alpha=BT_ALPHA, max_iter=10_000)
    expected = 1000 + 400 / math.log(10) * (theta - theta.mean())
    rows = bradley_terry(VOTES, rounds=50)
    assert {r.model: r.score for r in rows} == pytest.approx(dict(zip(models, expected)), abs=1e-6)
    assert [r.model for r in rows] == [models[i] for i in np.argsort(-theta)]  # best first
    assert sum(r.score for r in rows) / 3 == pytest.approx(ELO_BASE)
    # the counts beside the scores: x played 11 votes (5+2 against y, 2 against z, 2 ties/both-bad)
    x = next(r for r in rows if r.model == "x")
    assert (x.votes, x.wins, x.losses, x.ties) == (11, 7, 2, 2)


def test_bradley_terry_bootstrap_is_seeded_and_brackets_the_score():
    first = bradley_terry(VOTES, rounds=100, seed=7)
    again = bradley_terry(VOTES, rounds=100, seed=7)
    assert [(r.low, r.high) for r in first] == [(r.low, r.high) for r in again]
    for r in first:
        assert r.low < r.high
    # the intervals are percentiles of refits of resampled votes: recompute them here with choix
    rng = np.random.default_rng(7)
    models = ["x", "y", "z"]
    samples = []
    for _ in range(100):
        picked = [VOTES[i] for i in rng.integers(0, len(VOTES), size=len(VOTES))]
        theta = choix.ilsr_pairwise(3, hand_encoded(picked, models), alpha=BT_ALPHA, max_iter=10_000)
        samples.append(1000 + 400 / math.log(10) * (theta - theta.mean()))
    low, high = np.percentile(samples, [2.5, 97.5], axis=0)
    got = {r.model: (r.low, r.high) for r in first}
    assert [got[m][0] for m in models] == pytest.approx(list(low), abs=1e-6)
    assert [got[m][1] for m in models] == pytest.approx(list(high), abs=1e-6)


def test_a_model_that_never_loses_gets_a_finite_score():
    rows = bradley_terry([("x", "y", "model_a")] * 5 + [("z", "x", "model_b")] * 5, rounds=20)
    assert rows[0].model == "x" and all(math.isfinite(r.score) for r in rows)


def test_win_matrix_counts_on_a_hand_made_list():
    m = win_matrix(VOTES)
    assert m.models == ["x", "y", "z"]
    # rows beat columns, on either side
    assert m.wins == [[0, 5, 2], [2, 0, 1], [0, 1, 0]]
    assert m.ties == [[0, 2, 0], [2, 0, 1], [0, 1, 0]]
    assert m.rate(0, 1) == pytest.approx(5 / 7) and m.rate(1, 0) == pytest.approx(2 / 7)
    assert m.rate(2, 0) == 0.0 and m.rate(0, 0) is None
    assert win_matrix(VOTES, ["w"]).rate(0, 1) is None  # a model without votes


def test_bad_votes_are_refused():
    with pytest.raises(ValueError, match="winner"):
        win_matrix([("x", "y", "left")])
    with pytest.raises(ValueError, match="itself"):
        win_matrix([("x", "x", "tie")])


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_the_matrix_png_is_written_at_its_size(tmp_path):
    import matplotlib.image

    path = plot_win_matrix(win_matrix(VOTES), tmp_path / "m.png", dpi=80)
    width, height = matrix_figsize(3)
    assert png_size(path) == (round(width * 80), round(height * 80))
    pixels = matplotlib.image.imread(path)  # decodes: a valid PNG
    assert pixels.shape[:2] == (round(height * 80), round(width * 80))
    assert pixels[..., :3].std() > 0.05  # something was drawn
    # named after its content: the same matrix, the same file; another, another
    first = matrix_png(win_matrix(VOTES), tmp_path / "cache")
    assert matrix_png(win_matrix(VOTES), tmp_path / "cache") == first
    assert matrix_png(win_matrix(VOTES[:-1]), tmp_path / "cache") != first
    assert png_size(first) == (round(width * 100), round(height * 100))


def test_leaderboard_picks_its_view_by_the_number_of_models():
    assert leaderboard([], ["x"]).view == "none"
    two = leaderboard(TWO)
    assert two.view == "two-model" and two.headers == TWO_MODEL_HEADERS
    assert two.rows[0][:5] == ["x", 5, 2, 1, 1] and two.rows[1][:5] == ["y", 2, 5, 1, 1]
    assert "783 decisive votes (776 more)" in two.text and "194 decisive votes (187 more)" in two.text
    # a third model named by the arena but without votes yet switches to Bradley-Terry
    three = leaderboard(TWO, ["x", "y", "z"], rounds=20)
    assert three.view == "bradley-terry" and three.headers == BT_HEADERS
    assert three.rows[0][1] == "x" and {row[1] for row in three.rows} == {"x", "y", "z"}
    full = leaderboard(VOTES, rounds=20)
    value = full.value()
    assert value["headers"] == BT_HEADERS and [row[0] for row in value["data"]] == [1, 2, 3]
    assert {row[1]: row[2] for row in value["data"]} == pytest.approx(
        {r.model: round(r.score, 1) for r in bradley_terry(VOTES, rounds=0)}
    )
