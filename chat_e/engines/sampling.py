"""The logits processors behind an OpenAI request's ``seed`` and penalties (:class:`chat_e.data.settings.RequestSampling`),
for the local engine's ``generate``.

* :class:`OpenAIPenalties`: OpenAI's presence and frequency penalties, counted over the reply generated so far (not
  the prompt): ``logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)``.
* :class:`SeededSampling`: sampling from a generator of the request's own, seeded: transformers samples from torch's
  global generator, which every concurrent reply draws from too. The processor applies transformers' own warpers
  (temperature, top-k, top-p, as ``do_sample`` would), draws the next token with its generator and leaves only that
  token possible, so the greedy search it runs under picks it.
"""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..data.settings import RequestSampling


def sampling_warpers(config) -> LogitsProcessorList:
    """transformers' own warpers for ``config``'s sampling, in ``generate``'s order: temperature, top-k, top-p."""
    warpers = LogitsProcessorList()
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k:
        warpers.append(TopKLogitsWarper(config.top_k))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(config.top_p))
    return warpers


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties on the tokens after the first ``prompt_length`` (the reply's)."""

    def __init__(self, presence: float, frequency: float, prompt_length: int):
        self.presence, self.frequency, self.prompt_length = float(presence), float(frequency), prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        reply = input_ids[:, self.prompt_length :]
        counts = torch.zeros_like(scores).scatter_add_(1, reply, torch.ones_like(reply, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class SeededSampling(LogitsProcessor):
    """The next token drawn with ``seed``'s generator from the scores warped as ``config`` samples (temperature,
    top-k, top-p); every other token's score set to -inf."""

    def __init__(self, seed: int, config):
        self.generator = torch.Generator().manual_seed(int(seed))
        self.warpers = sampling_warpers(config)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        probs = torch.softmax(self.warpers(input_ids, scores).float(), dim=-1)
        chosen = torch.multinomial(probs.cpu(), 1, generator=self.generator).to(scores.device)
        return torch.full_like(scores, float("-inf")).scatter_(1, chosen, 0.0)


def sampling_processors(sampling: RequestSampling | None, config, prompt_length: int) -> LogitsProcessorList:
    """The processors ``sampling`` asks for under generation ``config`` (which a seeded sampled reply turns greedy:
    :class:`SeededSampling` samples in its place); an empty list when it asks for nothing."""
    processors = LogitsProcessorList()
    if sampling is None:
        return processors
    if sampling.presence_penalty or sampling.frequency_penalty:
        processors.append(OpenAIPenalties(sampling.presence_penalty, sampling.frequency_penalty, prompt_length))
    if sampling.seed is not None and config.do_sample and config.num_beams == 1:
        processors.append(SeededSampling(sampling.seed, config))
        # the search it runs under: greedy, the warpers' settings now SeededSampling's (unset, as a greedy config's)
        config.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    return processors
