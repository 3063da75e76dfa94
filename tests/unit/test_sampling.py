"""The logits processors behind an OpenAI request's penalties and seed (chat_e.engines.sampling), on hand-built
scores whose answer is worked out here."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from chat_e.data.settings import RequestSampling
from chat_e.engines.sampling import OpenAIPenalties, SeededSampling, sampling_processors


def test_penalties_count_the_reply_only_as_openai_defines_them():
    # prompt [2, 2], reply so far [1, 1, 3]: token 1 twice, token 3 once, token 2 only in the prompt
    input_ids = torch.tensor([[2, 2, 1, 1, 3]])
    scores = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    out = OpenAIPenalties(presence=0.5, frequency=1.0, prompt_length=2)(input_ids, scores.clone())
    # logit[j] - frequency * count[j] - presence * (count[j] > 0)
    assert out.tolist() == [[1.0, 2.0 - 2 * 1.0 - 0.5, 3.0, 4.0 - 1.0 - 0.5]]
    negative = OpenAIPenalties(presence=-1.0, frequency=0.0, prompt_length=2)(input_ids, scores.clone())
    assert negative.tolist() == [[1.0, 3.0, 3.0, 5.0]]  # a negative penalty favours what the reply already says


def test_seeded_sampling_repeats_with_its_seed_and_samples_as_warped():
    config = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0)
    scores = torch.zeros(1, 50)
    ids = torch.tensor([[0]])

    def draws(seed: int) -> list[int]:
        sampler = SeededSampling(seed, config)
        return [int(sampler(ids, scores.clone()).argmax()) for _ in range(20)]

    assert draws(7) == draws(7) != draws(8)
    chosen = SeededSampling(7, config)(ids, scores.clone())
    assert (chosen == 0).sum() == 1 and torch.isinf(chosen).sum() == 49  # one token left possible
    peaked = torch.tensor([[0.0, 5.0, 4.9, 0.0]])
    top1 = SeededSampling(3, GenerationConfig(do_sample=True, top_k=1))  # transformers' top-k warper applied
    assert {int(top1(ids, peaked.clone()).argmax()) for _ in range(20)} == {1}


@pytest.mark.parametrize("sampling, kinds, do_sample", [
    (None, [], True),
    (RequestSampling(), [], True),
    (RequestSampling(presence_penalty=0.5), ["OpenAIPenalties"], True),
    (RequestSampling(seed=1), ["SeededSampling"], False),  # sampling moves into the processor, the search greedy
    (RequestSampling(seed=1, frequency_penalty=1.0), ["OpenAIPenalties", "SeededSampling"], False),
])  # fmt: skip
def test_a_request_gets_the_processors_it_asks_for(sampling, kinds, do_sample):
    config = GenerationConfig(do_sample=True, temperature=0.7, num_beams=1)
    processors = sampling_processors(sampling, config, prompt_length=3)
    assert [type(p).__name__ for p in processors] == kinds and config.do_sample is do_sample
    greedy = GenerationConfig(do_sample=False, num_beams=1)
    assert sampling_processors(RequestSampling(seed=1), greedy, 3) == []  # a greedy reply is repeatable already
    assert RequestSampling(seed=5).for_choice(2).seed == 7 and RequestSampling().for_choice(2).seed is None
