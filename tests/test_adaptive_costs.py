"""The controller's cost model: its online correction, and the controller doing nothing when no
action pays, yet acting when one does, on a tiny model with synthetic costs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvwise.adaptive.controller import NO_GAIN, AdaptiveConfig, AdaptiveController
from kvwise.adaptive.costs import CostModel, FormCost, Holder, MachineCosts
from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.kv_actions import AssignMix
from tests.test_adaptive_controller import _occupied, _profile, _request, _run

pytestmark = pytest.mark.timeout(300)


def _costs(base: float, quantized_per_request: float) -> MachineCosts:
    """A machine whose step costs `base` plus 1 ms per full request and `quantized_per_request`
    per quantized one; bytes cost nothing."""
    full = FormCost(0.001, 0.0)
    quantized = FormCost(quantized_per_request, 0.0)
    return MachineCosts("test machine", "float32", base, {"full": full, "int8": quantized, "kivi2": quantized}, 0.0)


def test_the_online_correction_follows_measured_steps_within_bounds():
    model = CostModel(_costs(0.010, 0.001), smoothing=0.5)
    holders = [Holder("full", 0)] * 10  # predicted: 10 ms + 10 x 1 ms = 20 ms
    assert model.step_seconds(holders) == pytest.approx(0.020)
    for _ in range(20):
        model.observe(holders, 0.040)  # the machine runs twice as slow as calibrated
    assert model.scale == pytest.approx(2.0, rel=1e-3) and model.observed_steps == 20
    assert model.step_seconds(holders) == pytest.approx(0.040, rel=1e-3)
    model.observe(holders, 100.0)  # one absurd step moves it by at most the bound's share
    assert model.scale <= 2.0 + 0.5 * (4.0 - 2.0) + 1e-9
    model.observe([], 1.0)  # nothing decoded: nothing learned
    model.observe(holders, float("nan"))
    assert model.observed_steps == 21
    assert model.step_seconds([Holder("lowrank", 0)]) == model.step_seconds([Holder("full", 0)])  # unmeasured: as full


def test_a_verdict_weighs_tokens_gained_against_tokens_lost():
    model = CostModel(_costs(0.100, 0.001))
    running = [Holder("full", 0)] * 4
    # a step of 104 ms for 4 tokens; admitting a fifth costs 1 ms more: 5/0.105 against 4/0.104
    worth = model.verdict(running, running, [Holder("full", 0)], one_time_seconds=0.0, horizon_steps=100)
    assert worth.pays and worth.gain_tokens == pytest.approx((5 / 0.105 - 4 / 0.104) * 100 * 0.104)
    # the same, paid for with 10 s of quantizing: 385 tokens lost against about 100 gained
    assert not model.verdict(running, running, [Holder("full", 0)], 10.0, 100).pays
    # nothing admitted and a slower form: only a loss
    slower = [Holder("int8", 0)] + running[1:]
    assert not model.verdict(running, slower, [], 0.0, 100).pays


def _engine(model, costs: MachineCosts, num_blocks=32, **config):
    core = EngineCore(model, None, CacheConfig(block_size=4, num_blocks=num_blocks, prefix_caching=False))
    settings = {"min_prompt_tokens": 16, "steps_per_rung": 10**6, **config}
    controller = AdaptiveController(_profile(), AdaptiveConfig(**settings), CostModel(costs))
    core.attach_controller(controller)
    return core, controller


def test_admission_keeps_the_full_cache_when_no_mix_pays(llama):
    # quantized requests cost a second each per step: no wait they save is worth that
    core, controller = _engine(llama, _costs(0.001, 1.0))
    holder = _request(core, 40, 40, "chat", seed=3)
    core.add(holder)
    for _ in range(3):
        core.step()  # it decodes: the pool has 32 - 20 blocks left
    _occupied(core, 2)
    request = _request(core, 60, 16, "chat")  # 19 blocks: it does not fit, int8's 4 would
    _run(core, [request])
    assert (request.kv_choice.mix, request.kv_choice.reason) == ("full", NO_GAIN)
    assert request.kv is None and request.error is None and len(request.output) == 16
    assert controller.decisions.counts[("choose", NO_GAIN)] == 1


def test_admission_compresses_when_the_wait_it_saves_pays(llama):
    # a heavy step that one more request barely lengthens: admitting now is worth it
    core, controller = _engine(llama, _costs(1.0, 0.001))
    holder = _request(core, 40, 40, "chat", seed=3)
    core.add(holder)
    for _ in range(3):
        core.step()
    _occupied(core, 2)
    request = _request(core, 60, 16, "chat")
    _run(core, [request])
    assert (request.kv_choice.mix, request.kv_choice.reason) == ("int8", "pressure")
    assert controller.decisions.counts[("choose", "pressure")] == 1


def test_under_pressure_the_ladder_holds_when_quantizing_does_not_pay(llama):
    """The quantize rung is in force and a request is held back, but quantizing the running one
    would cost more than the held-back request's tokens gain: nothing is done, and it says so."""
    core, controller = _engine(llama, _costs(0.001, 1.0), num_blocks=30, low_watermark=0.2)
    first = _request(core, 64, 40, "chat", seed=1)
    core.add(first)
    for _ in range(3):
        core.step()
    waiting = _request(core, 64, 40, "chat", seed=2)
    core.scheduler.waiting.append(waiting)  # held back: its 26 blocks do not fit beside the first's
    controller.level = 1
    running, stalls = core.scheduler.running, (core.scheduler.memory_stalls + 1, 0)
    view = core.kv.controller_view(running, stalls, held_back=core.scheduler.waiting)
    assert view.held_back_tokens == (64 + 40,) and view.running[0].kv_form == "full"
    assert controller.before_step(view) == []
    assert controller.decisions.counts[("hold", NO_GAIN)] == 1
    controller.level = 3  # every rung: a spill frees nothing the pool would not reclaim when asked
    assert controller.before_step(replace(view, memory_stalls=stalls[0] + 1)) == []
    assert controller.decisions.counts[("hold", NO_GAIN)] == 2
    controller.level = 1
    # on a machine where a step is mostly weights, the same view pays: the running one is quantized
    controller.costs = CostModel(_costs(1.0, 0.001))
    actions = controller.before_step(core.kv.controller_view(running, (stalls[0] + 1, 0), held_back=[waiting]))
    assert [type(a) for a in actions] == [AssignMix] and actions[0].request is first and actions[0].quantize_now
    core.scheduler.waiting.remove(waiting)
    _run(core, [])


def test_the_engine_feeds_decode_steps_to_the_cost_model(llama):
    core, controller = _engine(llama, _costs(0.001, 0.001), num_blocks=256)
    requests = [_request(core, 40, 12, "chat", seed=s) for s in range(2)]
    _run(core, requests)
    assert [r.kv_choice.reason for r in requests] == ["spare", "spare"]
    assert controller.costs.observed_steps >= 5  # every decode-only step of both
    assert controller.costs.scale != 1.0  # a tiny model's step is not what the synthetic costs say


def test_an_action_does_not_pay_when_memory_frees_by_itself_soon(llama):
    """Quantizing the running request would admit the held-back one now, for a one-time cost of
    about 3 s. While the running request has most of its reply ahead, the steps saved pay for it;
    two steps before it ends, the held-back request would run anyway, and the same action does not."""
    core, controller = _engine(llama, _costs(1.0, 0.001), num_blocks=30, low_watermark=0.2)
    controller.profile.get("int8").extra_seconds_per_token = 0.05
    first = _request(core, 64, 40, "chat", seed=1)
    core.add(first)
    for _ in range(3):
        core.step()
    waiting = _request(core, 64, 40, "chat", seed=2)  # its 26 blocks do not fit beside the first's
    controller.level = 1
    stalls = core.scheduler.memory_stalls

    def actions_now():
        nonlocal stalls
        stalls += 1
        view = core.kv.controller_view(core.scheduler.running, (stalls, 0), held_back=[waiting])
        return controller.before_step(view)

    long_ahead = actions_now()
    assert [type(a) for a in long_ahead] == [AssignMix] and long_ahead[0].request is first
    while first.params.max_tokens - len(first.output) > 2:
        core.step()  # the engine's own steps weigh the same action as it nears its end
    holds = controller.decisions.counts[("hold", NO_GAIN)]
    assert actions_now() == []
    assert controller.decisions.counts[("hold", NO_GAIN)] == holds + 1
    last = controller.decisions.log[-1]  # the action log: a run of holds is one entry, counted
    assert (last["action"], last["reason"]) == ("hold", NO_GAIN) and last["times"] >= 2
    _run(core, [])
