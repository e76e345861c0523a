"""The sampler: greedy, temperature, top-k, top-p, seeds, logprobs, stop strings, bad params."""

from __future__ import annotations

import pytest
import torch

from kvwise.engine.sampling import SamplingParams, find_stop, sample


def logits(batch=1, vocab=50, seed=0):
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_takes_the_argmax_and_reports_its_logprob():
    scores = logits()
    (token,) = sample(scores, [SamplingParams(temperature=0, logprobs=3)], [None])
    assert token.token == int(scores[0].argmax())
    assert token.logprob == pytest.approx(float(torch.log_softmax(scores[0], -1).max()))
    assert len(token.top) == 3 and token.token in token.top


def test_a_seed_makes_a_row_independent_of_the_batch():
    scores = logits(batch=3)
    params = SamplingParams(temperature=1.0, seed=7)
    alone = sample(scores[1:2], [params], [seeded(7)])[0].token
    together = sample(scores, [SamplingParams(), params, SamplingParams()], [seeded(1), seeded(7), seeded(2)])
    assert together[1].token == alone


def test_top_k_and_top_p_restrict_the_draw():
    scores = logits()
    top_two = set(scores[0].topk(2).indices.tolist())
    generator = seeded(3)
    drawn = {sample(scores, [SamplingParams(top_k=2)], [generator])[0].token for _ in range(200)}
    assert drawn <= top_two and len(drawn) == 2
    greedy = int(scores[0].argmax())
    assert all(sample(scores, [SamplingParams(top_p=1e-6)], [generator])[0].token == greedy for _ in range(20))
    assert sample(scores, [SamplingParams(top_k=1)], [generator])[0].token == greedy


def test_high_temperature_spreads_the_draws():
    scores = logits()
    generator = seeded(4)
    cold = {sample(scores, [SamplingParams(temperature=0.05)], [generator])[0].token for _ in range(100)}
    hot = {sample(scores, [SamplingParams(temperature=5.0)], [generator])[0].token for _ in range(100)}
    assert len(hot) > len(cold)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n must be"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)


def test_stop_strings():
    assert SamplingParams(stop="END").stop == ["END"]
    assert find_stop("hello END world STOP", ["STOP", "END"]) == 6
    assert find_stop("hello", ["END"]) is None
    assert find_stop("END then END", ["END"], start=1) == 9
