"""The honest before/after of a preference run (chat_e.training.heldout), on a model whose answer is known by
construction: a unigram model (every position predicts the same distribution, softmax(c)), so a reply's
log-probability is the sum of log softmax(c) over its tokens, computed here with math alone."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from chat_e.data.stats import share
from chat_e.training.heldout import preference_metrics, reply_logprobs, scored_rows
from chat_e.training.preference import conversation_of, split_by_conversation

VOCAB = 12
#: the unigram logits: token 5 likely, token 6 unlikely, every other token 0
LOGITS = [0.0] * VOCAB
LOGITS[5], LOGITS[6] = 2.0, -2.0
LOG_Z = math.log(sum(math.exp(c) for c in LOGITS))


def logp(tokens: list[int]) -> float:
    return sum(LOGITS[t] - LOG_Z for t in tokens)


@pytest.fixture(scope="module")
def unigram():
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight.fill_(1.0)  # every token the same vector; attention and MLP add nothing
        model.model.norm.weight.fill_(1.0)  # RMSNorm(ones) = ones
        model.lm_head.weight.copy_(torch.tensor(LOGITS).unsqueeze(1).expand(VOCAB, 8) / 8)  # logits = LOGITS
    return model.eval()


def dpo(pairs):
    return {"prompt_ids": [[1, 2]] * len(pairs), "chosen_ids": [c for c, _ in pairs],
            "rejected_ids": [r for _, r in pairs]}  # fmt: skip


def test_a_model_that_prefers_chosen_in_3_of_4_pairs_reports_75_percent(unigram):
    # summed: chosen likelier in pairs 1-3 (pair 3: one token 0 against three), not in 4
    pairs = [([5, 5], [6, 6]), ([5], [6]), ([0], [0, 0, 0]), ([6, 6], [5])]
    rows, compared, preferred, _ = scored_rows(dpo(pairs), "dpo")
    seen = []
    table = reply_logprobs(unigram, rows, batch_size=3, pad_id=0, progress=lambda *p: seen.append(p))
    assert seen == [(3, 8), (6, 8), (8, 8)]  # the replies scored after each pass of 3 (what the Train page shows)
    for (_, reply), (total, tokens) in zip(rows, table.tolist()):
        assert total == pytest.approx(logp(reply), abs=1e-5) and tokens == len(reply)
    metrics = preference_metrics(table, compared, preferred)
    assert metrics["preferred_sum"] == share(3, 4).as_dict()
    assert metrics["preferred_sum"]["rate"] == 0.75
    # per token: pair 3 is a tie (the same token), so it is no preference; pairs 1, 2 are; 4 is not
    assert metrics["preferred_per_token"] == share(2, 4).as_dict()
    chosen = [c for c, _ in pairs]
    nll = -sum(logp(c) for c in chosen) / sum(map(len, chosen))
    assert metrics["reply_nll"] == pytest.approx(nll, rel=1e-6)
    assert 0.3 < metrics["preferred_sum"]["low"] < 0.75 < metrics["preferred_sum"]["high"] < 1  # Wilson, n = 4


def test_kto_pairs_desirable_and_undesirable_replies_of_one_prompt(unigram):
    kto = {"prompt_ids": [[1], [1], [2], [2], [3]], "completion_ids": [[5], [6], [6], [5], [0]],
           "label": [True, False, True, False, True]}  # fmt: skip
    rows, compared, preferred, pairing = scored_rows(kto, "kto")
    assert compared == [(0, 1), (2, 3)] and preferred == [0, 2, 4] and "same prompt" in pairing
    metrics = preference_metrics(reply_logprobs(unigram, rows, batch_size=2, pad_id=0), compared, preferred)
    assert metrics["preferred_sum"] == share(1, 2).as_dict()
    # no prompt holds both: every desirable reply against every undesirable one
    rows, compared, _, pairing = scored_rows({**kto, "prompt_ids": [[1], [2], [3], [4], [5]]}, "kto")
    assert sorted(compared) == [(0, 1), (0, 3), (2, 1), (2, 3), (4, 1), (4, 3)] and "across prompts" in pairing


def test_the_hold_out_keeps_each_conversation_on_one_side():
    rows = [{"prompt": [{"role": "user", "content": f"opener {i % 5}"}], "chosen": "a", "rejected": "b"}
            for i in range(20)] + [{"prompt": "x", "chosen": "a", "rejected": "b", "session_id": "s"}] * 4  # fmt: skip
    groups = [conversation_of(r) for r in rows]
    train, held = split_by_conversation(rows, groups, n_eval=6, seed=1)
    assert len(train) + len(held) == len(rows) and 6 <= len(held) <= len(rows) // 2 + 4
    train_groups = {conversation_of(r) for r in train}
    assert train_groups and not train_groups & {conversation_of(r) for r in held}
    assert split_by_conversation(rows, groups, n_eval=6, seed=1) == (train, held)  # seeded
