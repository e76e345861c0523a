"""A request whose KV changed while it ran is scored under the KV each token was generated with:
the engine logs the controller's changes (`Request.kv_changes`) and the bench's scorer makes them
again at the same token counts (`bench/engine_scoring.replay_nll`)."""

from __future__ import annotations

import pytest

from kvwise.bench.engine_scoring import ScoredReply, replay_nll, reply_nll
from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.kv_actions import AssignMix, KVChange
from kvwise.engine.sampling import SamplingParams
from tests.conftest import TINY_MODELS, random_ids

pytestmark = pytest.mark.timeout(300)

QUANTIZE = "kivi2:residual_length=8:group_size=8"
CAP = "streaming_llm@max=48+kivi2:residual_length=8:group_size=8"


class _Scripted:
    """A controller that changes a running request's mix after it generated a given number of
    tokens, as the adaptive controller's ladder would: {output tokens: (mix, quantize now)}."""

    def __init__(self, script: dict[int, tuple[str, bool]]):
        self.script = dict(script)

    @staticmethod
    def check_hint(hint):
        pass

    def admit(self, request, view):
        return None

    def before_step(self, view):
        actions = []
        for running in view.running:
            change = self.script.pop(len(running.request.output), None)
            if change is not None and running.past_prefill:
                actions.append(AssignMix(running.request, change[0], quantize_now=change[1], kind="test"))
        return actions


def _generate(model, prompt: list[int], script: dict[int, tuple[str, bool]]):
    core = EngineCore(model, None, CacheConfig(block_size=4, num_blocks=256, prefix_caching=False))
    core.attach_controller(_Scripted(script))
    request = core.make_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0))
    core.add(request)
    while core.has_work:
        core.step()
    assert request.error is None and len(request.output) == 40
    return request


def test_a_request_whose_kv_changed_mid_run_is_scored_under_the_kv_each_token_had():
    model = TINY_MODELS["llama"]()
    prompt = random_ids(1, 60, seed=7)[0].tolist()
    # full for 12 tokens, then its settled blocks quantized to 2 bits, then a cap of 48 tokens
    live = _generate(model, prompt, {12: (QUANTIZE, True), 24: (CAP, False)})
    assert [(change.mix, change.quantize_now) for change in live.kv_changes] == [(QUANTIZE, True), (CAP, False)]
    assert [change.at for change in live.kv_changes] == [len(prompt) + 11, len(prompt) + 23]
    # each token's live log-probability, the one it was generated with (the last is not scored:
    # a reply of n tokens is read as n - 1 forced tokens after the prompt's own forward)
    reply = live.output[:-1]
    own_nll = -sum(entry[token] for entry, token in zip(live.logprobs, reply)) / len(reply)

    (replayed,) = replay_nll(model, None, [ScoredReply(prompt, reply, tuple(live.kv_changes))], block_size=4)
    assert replayed == pytest.approx(own_nll, abs=1e-4)
    # scored under the mix it ended with, from the start, or under the full cache: another score
    plans = [(KVChange(0, CAP),), ()]
    ended, full = (replay_nll(model, None, [ScoredReply(prompt, reply, plan)], block_size=4)[0] for plan in plans)
    assert abs(ended - own_nll) > 1e-3 and abs(full - own_nll) > 1e-3


def test_a_change_at_admission_is_the_mix_from_the_start():
    model = TINY_MODELS["llama"]()
    prompt, reply = random_ids(1, 50, seed=8)[0].tolist(), random_ids(1, 20, seed=9)[0].tolist()
    from_start = replay_nll(model, None, [ScoredReply(prompt, reply, (KVChange(0, "snapkv@0.5+int8"),))])
    assert from_start == reply_nll(model, None, "snapkv@0.5+int8", [(prompt, reply)])
    assert from_start != reply_nll(model, None, None, [(prompt, reply)])
