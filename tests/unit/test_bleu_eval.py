"""BLEU/chrF scores (hand-computed and published values, and sacrebleu's), the batching helpers and the settings of
the BLEU generation eval (training and 2-rank runs: tests/integration/test_bleu_eval_training.py,
tests/distributed/test_bleu_eval_distributed.py)."""

from __future__ import annotations

import math
import types
from collections import Counter

import pytest
import sacrebleu

from hf_ext.evaluation.bleu import (
    BleuEvalCallback,
    BleuEvalConfig,
    compute_bleu_chrf,
    format_samples_table,
    length_batches,
    metric_prefix,
    prompt_ids,
    shard_batches,
)

# ---------------------------------------------------------------------------------------------- scores
HYPS = ["the cat sat on the mat", "", "hello there general kenobi", "", "a completely different answer"]
REFS = ["the cat sat on the mat", "i am fine thank you", "hello there general kenobi", "nothing", "the right one"]


def _ngrams(items, n: int) -> Counter:
    return Counter(tuple(items[i : i + n]) for i in range(len(items) - n + 1))


def oracle_bleu(hyps: list[str], refs: list[str]) -> float:
    """Corpus BLEU as sacreBLEU defines it (Post 2018; Papineni et al. 2002), written here from the definition:
    clipped n-gram counts and totals summed over the corpus for n = 1..4; the k-th zero count among them counts as
    1 / (2^k x total) ("exp" smoothing); a total of zero gives 0; brevity penalty exp(1 - r/c) when the corpus
    hypothesis length c is below the reference length r (0 when c = 0). Tokens are whitespace-separated: the
    strings used here have no punctuation, where sacreBLEU's 13a tokenizer splits the same way."""
    correct, total, c, r = [0] * 4, [0] * 4, 0, 0
    for hyp, ref in zip(hyps, refs):
        h, t = hyp.split(), ref.split()
        c, r = c + len(h), r + len(t)
        for n in range(1, 5):
            hyp_counts, ref_counts = _ngrams(h, n), _ngrams(t, n)
            correct[n - 1] += sum(min(k, ref_counts[g]) for g, k in hyp_counts.items())
            total[n - 1] += max(0, len(h) - n + 1)
    if c == 0 or 0 in total:
        return 0.0
    logs, zeros = [], 0
    for k, t in zip(correct, total):
        if k == 0:
            zeros += 1
        logs.append(math.log(k / t if k else 1 / (2**zeros * t)))
    brevity = 1.0 if c >= r else math.exp(1 - r / c)
    return 100 * brevity * math.exp(sum(logs) / 4)


def oracle_chrf(hyps: list[str], refs: list[str], order: int = 6, beta: float = 2.0) -> float:
    """Corpus chrF as sacreBLEU defines it (Popović 2015; sacreBLEU's defaults: character n-grams of 1..6 with
    whitespace removed, beta 2), written here from the definition: per order the character n-gram counts of
    hypotheses, references and their clipped matches, summed over the corpus; precision and recall averaged over
    the orders both sides have n-grams of; F_beta of the two averages."""
    stats = [[0, 0, 0] for _ in range(order)]
    for hyp, ref in zip(hyps, refs):
        h, t = "".join(hyp.split()), "".join(ref.split())
        for n in range(1, order + 1):
            hyp_counts, ref_counts = _ngrams(h, n), _ngrams(t, n)
            stats[n - 1][0] += sum(hyp_counts.values())
            stats[n - 1][1] += sum(ref_counts.values())
            stats[n - 1][2] += sum(min(k, ref_counts[g]) for g, k in hyp_counts.items())
    seen = [(m / nh, m / nr) for nh, nr, m in stats if nh and nr]
    if not seen:
        return 0.0
    p, r = sum(x for x, _ in seen) / len(seen), sum(y for _, y in seen) / len(seen)
    return 0.0 if p + r == 0 else 100 * (1 + beta**2) * p * r / (beta**2 * p + r)


def test_chrf_oracle_by_hand():
    """ "ab" against "abc": 1-grams a, b of a, b, c: P = 1, R = 2/3; 2-grams ab of ab, bc: P = 1, R = 1/2; no longer
    hypothesis n-grams. Averages P = 1, R = 7/12; F_2 = 5 P R / (4 P + R) = (35/12) / (55/12) = 7/11."""
    assert oracle_chrf(["ab"], ["abc"]) == pytest.approx(700 / 11, abs=1e-9)
    assert compute_bleu_chrf(["ab"], ["abc"])["chrf"] == pytest.approx(700 / 11, abs=1e-9)


def test_bleu_oracle_by_hand():
    """The sentence of test_scores_equal_sacrebleu_on_a_hand_computed_sentence, through the oracle."""
    assert oracle_bleu(["the cat sat on the mat"], ["the cat is on the mat"]) == pytest.approx(
        100 * (5 / 6 * 3 / 5 * 1 / 4 * 1 / 6) ** 0.25, abs=1e-9
    )


@pytest.mark.parametrize(
    "hyps,refs",
    [
        (HYPS, REFS),  # mixed, with empty hypotheses
        (REFS, REFS),  # perfect match
        (["", ""], ["some words here", "more words"]),  # all empty
        (["a b c d e f"], ["a b c d x y"]),
        (["the the the the the the the"], ["the cat is on the mat"]),  # clipped counts
        (["the cat", "a dog ran into the house today"], ["the cat sat", "a dog ran to the house"]),  # corpus sums
    ],
)
def test_scores_equal_an_independent_oracle(hyps, refs):
    """hf-ext's scores against BLEU and chrF computed in this file from their definitions (not by sacreBLEU)."""
    scores = compute_bleu_chrf(hyps, refs)
    assert scores["bleu"] == pytest.approx(oracle_bleu(hyps, refs), rel=1e-12, abs=1e-9)
    assert scores["chrf"] == pytest.approx(oracle_chrf(hyps, refs), rel=1e-12, abs=1e-9)


def test_scores_equal_sacrebleu_on_a_hand_computed_sentence():
    """ "the cat sat on the mat" against "the cat is on the mat" (6 tokens each, no brevity penalty):
    1-grams: 5 of 6 match (the, cat, on, the, mat)        -> 5/6
    2-grams: "the cat", "on the", "the mat" of 5          -> 3/5
    3-grams: "on the mat" of 4                            -> 1/4
    4-grams: none of 3                                    -> 0, so plain BLEU is 0 and sacrebleu's default "exp"
    smoothing counts it as 1 / (2 x 3): the k-th zero precision becomes 1 / (2^k x total).
    BLEU = 100 x (5/6 x 3/5 x 1/4 x 1/6) ** (1/4)."""
    expected = 100 * (5 / 6 * 3 / 5 * 1 / 4 * 1 / 6) ** 0.25
    assert expected == pytest.approx(37.99178428257963, abs=1e-9)
    scores = compute_bleu_chrf(["the cat sat on the mat"], ["the cat is on the mat"])
    assert scores["bleu"] == pytest.approx(expected, abs=1e-9)


def test_brevity_penalty_by_hand():
    """A 4-token hypothesis that is the start of an 8-token reference: every n-gram precision is 1, and the brevity
    penalty exp(1 - r/c) = exp(1 - 8/4) = exp(-1) gives BLEU = 100 / e."""
    scores = compute_bleu_chrf(["a b c d"], ["a b c d e f g h"])
    assert scores["bleu"] == pytest.approx(100 * math.exp(-1), abs=1e-9)


PAPINENI_REFS = [
    "It is a guide to action that ensures that the military will forever heed Party commands",
    "It is the guiding principle which guarantees the military forces always being under the command of the Party",
    "It is the practical guide for the army always to heed the directions of the party",
]


@pytest.mark.parametrize(
    "candidate,matches,length",
    [
        ("It is a guide to action which ensures that the military always obeys the commands of the party", 17, 18),
        ("It is to insure the troops forever hearing the activity guidebook that party direct", 8, 14),
    ],
)
def test_published_modified_unigram_precisions(candidate, matches, length):
    """Papineni et al. (2002), "BLEU: a Method for Automatic Evaluation of Machine Translation", Example 1: against
    these three references candidate 1 has a modified unigram precision of 17/18, candidate 2 of 8/14."""
    bleu = sacrebleu.corpus_bleu([candidate], [[r] for r in PAPINENI_REFS], tokenize="none")
    assert (bleu.counts[0], bleu.totals[0]) == (matches, length)
    assert compute_bleu_chrf([candidate], [PAPINENI_REFS[0]])["bleu"] == pytest.approx(
        sacrebleu.corpus_bleu([candidate], [[PAPINENI_REFS[0]]]).score, abs=1e-9
    )


def test_perfect_match_is_100_and_empty_is_0():
    assert compute_bleu_chrf(REFS, REFS) == {"bleu": pytest.approx(100.0), "chrf": pytest.approx(100.0)}
    assert compute_bleu_chrf(["", ""], ["a b c", "d e f"]) == {"bleu": 0.0, "chrf": 0.0}
    assert compute_bleu_chrf([None, "x"], ["a", "x"]) == compute_bleu_chrf(["", "x"], ["a", "x"])
    assert compute_bleu_chrf([], []) == {"bleu": 0.0, "chrf": 0.0}
    with pytest.raises(ValueError, match="2 hypotheses for 1 references"):
        compute_bleu_chrf(["a", "b"], ["a"])


# ---------------------------------------------------------------------------------------------- batching helpers
def test_length_batches_and_shards_cover_every_row_once():
    lengths = [5, 17, 3, 17, 9, 1, 12, 12, 30, 2, 8]
    bucketed = length_batches(lengths, 3)
    flat = [i for b in bucketed for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)
    assert flat.index(1) < flat.index(3) and flat.index(6) < flat.index(7)  # ties keep their order
    assert [i for b in length_batches(lengths, 3, bucket=False) for i in b] == list(range(len(lengths)))
    shards = [shard_batches(bucketed, r, 2) for r in range(2)]
    assert sorted(i for s in shards for b in s for i in b) == list(range(len(lengths)))
    assert abs(len(shards[0]) - len(shards[1])) <= 1


def test_metric_prefix_and_table():
    assert metric_prefix({"eval_loss": 1.0, "eval_runtime": 2.0}) == "eval"
    assert metric_prefix({"eval_chat_loss": 1.0, "eval_chat_runtime": 2.0}) == "eval_chat"
    table = format_samples_table(
        [{"index": 0, "context": "x " * 80 + "newest", "generation": "hi", "reference": "yo"}]
    )
    assert "newest" in table and "hi" in table and "yo" in table
    with pytest.raises(ValueError, match="generation_batch_size"):
        BleuEvalConfig(generation_batch_size=0)


# ---------------------------------------------------------------------------------------------- decoder-only rows
def test_prompt_of_a_decoder_only_row_ends_before_its_first_label():
    row = {"input_ids": [5, 6, 7, 8, 9, 2], "labels": [-100, -100, -100, 8, 9, 2]}
    assert prompt_ids(row, is_encoder_decoder=False) == [5, 6, 7]
    assert prompt_ids(row, is_encoder_decoder=True) == [5, 6, 7, 8, 9, 2]  # an encoder reads everything
    assert prompt_ids({"input_ids": [5, 6], "labels": [7, 8, 2]}, False) == [5, 6]  # not aligned: a seq2seq row
    assert prompt_ids({"input_ids": [5, 6]}, False) == [5, 6]


def test_decoder_only_lengths_count_new_tokens():
    from transformers import BlenderbotConfig, LlamaConfig

    class Model:  # only the config is read
        def __init__(self, config):
            self.config = config

    args = types.SimpleNamespace(generation_num_beams=1, generation_max_length=24, generation_min_length=2)
    callback = BleuEvalCallback()
    causal = callback.generation_kwargs(args, Model(LlamaConfig()))
    assert causal == {"num_beams": 1, "max_new_tokens": 24, "min_new_tokens": 2}
    seq2seq = callback.generation_kwargs(args, Model(BlenderbotConfig()))
    assert seq2seq == {"num_beams": 1, "max_length": 24, "min_length": 2}
    call = {"max_new_tokens": 10}  # an explicit new-token limit of the call wins
    assert callback.generation_kwargs(args, Model(LlamaConfig()), call)["max_new_tokens"] == 10
