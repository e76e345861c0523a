"""The sampler: greedy, temperature, top-k, top-p, seeds, logprobs, stop strings, bad params."""

from __future__ import annotations

import pytest
import torch

from kvwise.engine.sampling import SamplingParams, apply_penalties, find_stop, min_p_cut, sample


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


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    scores, prompt, output = logits(vocab=40), [3, 5, 5, 11], [11, 20, 3]
    for penalty in (1.3, 0.7):
        ours = apply_penalties(scores[0], SamplingParams(repetition_penalty=penalty), prompt, output)
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), scores.clone())[0]
        assert torch.allclose(ours, theirs)
        assert not torch.equal(ours, scores[0])  # it did change the seen tokens


def test_frequency_and_presence_penalties_follow_openai():
    # logit[j] -= frequency * count[j] + presence * (count[j] > 0), over the output only
    scores, output = logits(vocab=30), [4, 4, 4, 9]
    settings = SamplingParams(frequency_penalty=0.5, presence_penalty=1.5)
    ours = apply_penalties(scores[0], settings, [4, 9, 17], output)
    expected = scores[0].clone()
    expected[4] -= 0.5 * 3 + 1.5
    expected[9] -= 0.5 * 1 + 1.5
    assert torch.allclose(ours, expected)  # token 17 is only in the prompt: untouched
    # greedy follows the penalized logits: a token made the argmax is penalized off it
    top = int(scores[0].argmax())
    pushed = sample(scores, [SamplingParams(temperature=0, frequency_penalty=2.0)], [None], [([], [top] * 20)])
    assert pushed[0].token != top


def test_min_p_matches_transformers():
    from transformers import MinPLogitsWarper

    scores = logits(vocab=60)
    for min_p in (0.05, 0.3):
        ours = min_p_cut(scores[0], min_p)
        theirs = MinPLogitsWarper(min_p)(None, scores.clone())[0]
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
        assert torch.isinf(ours).any() and not torch.isinf(ours).all()
    kept = set(torch.nonzero(~torch.isinf(min_p_cut(scores[0], 0.3))).flatten().tolist())
    draws = {sample(scores, [SamplingParams(min_p=0.3, seed=s)], [seeded(s)])[0].token for s in range(40)}
    assert draws <= kept


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in"),
        ({"repetition_penalty": 0}, "repetition_penalty must be in"),
        ({"min_p": 1.5}, "min_p must be in"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be"),
    ],
)
def test_bad_penalty_params(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)
