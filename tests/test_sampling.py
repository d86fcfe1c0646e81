"""Sampling against transformers' logits processors and hand-computed cases."""

import mlx.core as mx
import numpy as np
import pytest
import torch
from transformers.generation import logits_process as hf

from pipeline.util.errors import UserError
from pipeline.runtime.requests import SamplingParams
from pipeline.runtime.sampling import Sampler


def hf_processed(logits: np.ndarray, history: list[int], p: SamplingParams) -> np.ndarray:
    ids = torch.tensor([history])
    scores = torch.tensor(logits[None])
    processors = [hf.RepetitionPenaltyLogitsProcessor(p.repetition_penalty),
                  hf.TemperatureLogitsWarper(p.temperature)]
    if p.top_k:
        processors.append(hf.TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        processors.append(hf.TopPLogitsWarper(p.top_p))
    if p.min_p:
        processors.append(hf.MinPLogitsWarper(p.min_p))
    for proc in processors:
        scores = proc(ids, scores)
    return scores[0].numpy()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, repetition_penalty=1.3),
])
def test_processed_logits_match_transformers(params):
    rng = np.random.default_rng(0)
    for _ in range(5):
        logits = rng.normal(size=200).astype(np.float32) * 3
        history = [int(t) for t in rng.integers(0, 200, size=30)]
        ours = np.array(Sampler(params).processed_logits(mx.array(logits), history))
        theirs = hf_processed(logits, history, params)
        assert np.array_equal(np.isinf(ours), np.isinf(theirs))
        kept = ~np.isinf(ours)
        assert np.allclose(ours[kept], theirs[kept], atol=1e-5)


def test_repetition_penalty_by_hand():
    greedy = Sampler(SamplingParams(temperature=0, repetition_penalty=1.1))
    assert greedy(mx.array([2.0, 1.9]), history=[]) == 0
    assert greedy(mx.array([2.0, 1.9]), history=[0]) == 1  # 2.0 / 1.1 < 1.9
    assert greedy(mx.array([-1.0, -1.05]), history=[0]) == 1  # -1.0 * 1.1 < -1.05


def test_seeded_sampling_follows_the_distribution_and_repeats():
    logits = mx.array(np.log([0.6, 0.3, 0.1]).astype(np.float32))
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    draws = [sampler(logits, []) for _ in range(3000)]
    freq = np.bincount(draws, minlength=3) / len(draws)
    assert np.allclose(freq, [0.6, 0.3, 0.1], atol=0.03)
    again = Sampler(SamplingParams(temperature=1.0, seed=3))
    assert [again(logits, []) for _ in range(50)] == draws[:50]


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.01), dict(top_k=-1),
                                 dict(min_p=1.0), dict(repetition_penalty=0)])
def test_invalid_values_are_user_errors(bad):
    with pytest.raises(UserError):
        SamplingParams(**bad).validate()
