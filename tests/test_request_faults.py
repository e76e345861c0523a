"""One request can hurt no other: values that would break a batched step are refused or made
safe before it, and a fault inside a step fails only the requests whose part raises."""

from __future__ import annotations

import pytest
import torch

from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.detokenizer import IncrementalText
from kvwise.engine.sampling import SamplingParams, sample
from kvwise.kv.quantizer import make_quantizer
from kvwise.policies.mix import Mix
from tests.conftest import random_ids
from tests.test_engine_core import _CharTokenizer


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-6])
def test_a_vanishing_temperature_samples_greedily(temperature):
    logits = torch.randn(2, 50) * 30
    params = [SamplingParams(temperature=temperature, top_p=1e-300), SamplingParams(temperature=0)]
    tokens = sample(logits, params, [None, None])
    assert [t.token for t in tokens] == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0])
def test_a_temperature_that_is_not_a_finite_number_is_refused(value):
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=value)


def test_stop_strings_are_bounded():
    with pytest.raises(ValueError, match="at most 16 stop strings"):
        SamplingParams(stop=[f"s{i}" for i in range(17)])
    with pytest.raises(ValueError, match="at most 256 characters"):
        SamplingParams(stop=["x" * 257])


def test_quantizer_spellings_reduce_to_one_canonical_spec():
    spellings = ["kivi4", "KIVI4", "kivi4:sink_tokens=1", "kivi4:group_size=32:residual_length=128", "kivi:bits=4"]
    assert len({Mix(quant=spelling).quant for spelling in spellings}) == 1
    spec = make_quantizer("kivi2:group_size=16:residual_length=64").spec
    assert make_quantizer(spec).spec == spec and spec != make_quantizer("kivi2").spec


def test_a_quantizer_that_does_not_fit_the_model_is_refused_before_the_step(llama):
    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=32))
    settings = Mix(quant="kivi4:value_group_size=7")
    with pytest.raises(ValueError, match="channel groups of 7 do not fit head_dim 16"):
        core.make_request([5, 6, 7], SamplingParams(max_tokens=2), kv=settings)


def test_incremental_text_decodes_linearly():
    """Characters decoded over a whole stream: about one window per token, not the whole output."""

    class Counting(_CharTokenizer):
        decoded = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.decoded += len(ids)
            return super().decode(ids)

    work = {}
    for length in (500, 2000):
        Counting.decoded = 0
        text = IncrementalText(Counting(), stop=["zzz"], eos=0)
        out = "".join(text.add(ord("a") + i % 20, i == length - 1) for i in range(length))
        assert len(out) == length
        work[length] = Counting.decoded
    assert work[2000] / work[500] < 4.5  # quadratic would be 16


@pytest.mark.smollm
def test_incremental_text_equals_the_full_decode(smollm):
    _, tokenizer = smollm
    text = "Grüße aus Köln! 東京タワー 🚀 emoji, café — and ‘quotes’.\n" * 3
    ids = tokenizer(text, add_special_tokens=False).input_ids
    streamed = IncrementalText(tokenizer, eos=tokenizer.eos_token_id)
    out = "".join(streamed.add(token, index == len(ids) - 1) for index, token in enumerate(ids))
    assert out == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_fault_in_a_step_fails_only_the_request_that_raises(llama, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = [random_ids(1, 9, seed=s)[0].tolist() for s in (1, 2)]

    def run(with_poison: bool):
        core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=64))
        canary, poison = (core.make_request(p, params) for p in prompts)
        forward = core.runner.forward

        def faulty(chunks, compact=None):
            if with_poison and any(c.request is poison and len(poison.output) >= 2 for c in chunks):
                raise RuntimeError("injected fault")
            return forward(chunks, compact)

        monkeypatch.setattr(core.runner, "forward", faulty)
        core.add(canary)
        core.add(poison)
        events = []
        while core.has_work:
            events.extend(core.step())
        return core, canary, poison, events

    _, clean_canary, _, _ = run(with_poison=False)
    core, canary, poison, events = run(with_poison=True)
    assert canary.completion.token_ids == clean_canary.completion.token_ids  # intact
    assert poison.completion.finish_reason == "error" and "RuntimeError" in poison.error
    assert [e.finish_reason for e in events if e.request is poison][-1] == "error"
    failed_step = next(r for r in core.step_log if len({c[0] for c in r.chunks}) == 2 and r.step > 2)
    assert any(end - start == 1 for _, _, start, end in failed_step.chunks)  # decoding side by side
    assert {canary.request_id, poison.request_id} <= {c[0] for c in failed_step.chunks}
    assert not core.scheduler.running and not core.scheduler.waiting
    # the failed request's blocks are back; only the cache holds any
    assert core.kv.stats().used_blocks == len(core.kv._tree)


def test_a_flooding_tenant_gets_the_429_and_another_keeps_its_share(llama):
    """max_queue 8, two tenants known: alice, flooding first at twice the queue, is held to half of
    it; bob, arriving later and under his share, is never refused."""
    import asyncio

    from kvwise.server.async_engine import AsyncEngine
    from kvwise.server.protocol import OpenAIError

    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=64))
    engine = AsyncEngine(core, max_queue=8, tenants=2)  # not started: everything submitted stays queued

    def submit(tenant: str) -> bool:
        request = core.make_request([5, 6, 7], SamplingParams(max_tokens=1), tenant=tenant)
        try:
            engine.submit([request])
            return True
        except OpenAIError as error:
            assert error.status == 429 and error.code in ("tenant_queue_full", "queue_full")
            return False

    async def scenario():
        alice = sum(submit("alice") for _ in range(16))
        bob = [submit("bob") for _ in range(4)]
        return alice, bob

    alice, bob = asyncio.run(scenario())
    assert alice == 4 and bob == [True] * 4
    alone = AsyncEngine(core, max_queue=8, tenants=1)
    engine = alone

    async def single():
        return sum(submit("solo") for _ in range(10))

    assert asyncio.run(single()) == 8  # a server with one tenant lets it use the whole queue
