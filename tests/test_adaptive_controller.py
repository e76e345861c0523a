"""The adaptive controller on a tiny model with a synthetic profile: the choice at admission per
class, escalation and de-escalation with hysteresis under a pressure trace, explicit settings and
pinned mixes winning, and every decision reaching the counters."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvwise.adaptive.controller import AdaptiveConfig, AdaptiveController
from kvwise.adaptive.profile import MixProfile, Profile
from kvwise.adaptive.request_class import check_hint, classify
from kvwise.engine.block_table import Place
from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.kv_actions import AssignMix, SpillPrefixes
from kvwise.engine.sampling import SamplingParams
from kvwise.policies.mix import Mix
from tests.conftest import random_ids

pytestmark = pytest.mark.timeout(300)


def _entry(mix, fraction, retrieval, chat, long_generation, extra=0.0):
    quality = {"retrieval": retrieval, "chat": chat, "long_generation": long_generation}
    return MixProfile(mix, fraction, extra, quality)


def _profile() -> Profile:
    return Profile(
        "tiny",
        "0" * 32,
        64,
        [
            _entry("full", 1.0, 1.0, 1.0, 1.0),
            _entry("int8", 0.20, 1.0, 0.99, 0.99),
            _entry("kivi2", 0.12, 0.8, 0.95, 0.6),
            _entry("snapkv@0.75", 0.25, 1.0, 0.9, 0.5),
            _entry("snapkv@0.5", 0.5, 1.0, 0.985, 0.7),
            _entry("snapkv@0.9+kivi4", 0.03, 0.99, 0.5, 0.1),
            _entry("kvzip@0.9+kivi4", 0.02, 1.0, 0.5, 0.1),  # cheapest, but its pass needs free blocks
        ],
    )


def _engine(model, num_blocks=64, **config):
    core = EngineCore(model, None, CacheConfig(block_size=4, num_blocks=num_blocks, prefix_caching=False))
    controller = AdaptiveController(_profile(), AdaptiveConfig(**{"min_prompt_tokens": 16, **config}))
    core.attach_controller(controller)
    return core, controller


def _request(core, length, max_tokens, hint="auto", seed=1, kv=None):
    ids = random_ids(1, length, seed=seed)[0].tolist()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return core.make_request(ids, params, kv=kv, kv_auto=None if kv is not None else hint)


def _run(core, requests):
    for request in requests:
        core.add(request)
    while core.has_work:
        core.step()


def test_classes_from_features_and_hints():
    assert classify(3000, 16) == "retrieval"
    assert classify(3000, 128) == "chat"
    assert classify(3000, 16, turns=3) == "chat"
    assert classify(200, 512) == "long_generation"
    assert classify(200, 16, compresses_document=True) == "retrieval"
    assert classify(3000, 16, hint="chat") == "chat"
    with pytest.raises(ValueError, match="unknown kv_profile 'fast'"):
        check_hint("fast")  # the one check, made when the request enters the engine


def _occupied(core, blocks: int) -> None:
    """Blocks held outside any request (another tenant's work, as far as the controller sees)."""
    core.kv._pool.allocate(blocks)


@pytest.mark.parametrize(
    ("hint", "expected"),
    [("retrieval", "snapkv@0.9+kivi4"), ("chat", "int8"), ("long_generation", "int8")],
)
def test_admission_picks_the_cheapest_mix_meeting_the_floor_per_class(llama, hint, expected):
    core, controller = _engine(llama, num_blocks=32, quality=0.98, steps_per_rung=10**6)  # the ladder stays put
    # 14 + the request's 19 blocks (60 + 16 tokens) > 32: no memory to spare, nor for kvzip's pass
    _occupied(core, 14)
    request = _request(core, 60, 16, hint)
    _run(core, [request])
    choice = request.kv_choice
    assert (choice.klass, choice.mix, choice.reason) == (hint, expected, "pressure")
    assert choice.predicted_quality >= 0.98
    assert controller.decisions.counts[("choose", "pressure")] == 1


def test_with_memory_to_spare_auto_keeps_everything(llama):
    core, controller = _engine(llama, num_blocks=256)
    requests = [_request(core, 60, 4, seed=s) for s in range(3)]
    _run(core, requests)
    assert [r.kv_choice.mix for r in requests] == ["full"] * 3
    assert all(r.kv is None for r in requests)
    assert controller.decisions.counts[("choose", "spare")] == 3


def test_explicit_settings_win_and_pinned_classes_hold(llama):
    core, controller = _engine(llama, num_blocks=24, class_mix={"chat": "snapkv@0.5"})
    explicit = _request(core, 60, 4, kv=Mix("streaming_llm", 0.5))
    pinned = _request(core, 60, 4, hint="chat", seed=2)
    _run(core, [explicit, pinned])
    assert explicit.kv_choice is None and explicit.kv.policy == "streaming_llm"
    assert pinned.kv_choice.reason == "pinned" and pinned.kv_choice.mix == "snapkv@0.5"
    assert pinned.kv.policy == "snapkv" and pinned.kv.ratio == 0.5
    assert controller.decisions.counts[("choose", "pinned")] == 1


def test_quality_floor_and_profile_errors():
    with pytest.raises(ValueError, match=r"quality floor must be in \(0, 1\]"):
        AdaptiveConfig(quality=1.5)
    with pytest.raises(ValueError, match="unknown request class 'batch'"):
        AdaptiveConfig(class_mix={"batch": "full"})
    with pytest.raises(ValueError, match="unknown component"):
        AdaptiveConfig(class_mix={"chat": "zip@0.5"})


def test_allowed_quantizers_limit_the_choice(llama):
    core, _ = _engine(llama, num_blocks=32, allowed_quants=("kivi2",), steps_per_rung=10**6)
    _occupied(core, 14)
    request = _request(core, 60, 16, "chat")
    _run(core, [request])
    assert request.kv_choice.mix == "snapkv@0.5"  # int8 is not allowed, kivi2 misses the floor


def test_ladder_escalates_under_pressure_and_comes_down_with_hysteresis(llama):
    core, controller = _engine(llama, num_blocks=100, steps_per_rung=2)
    # (usage, held back): memory holds requests back, then nobody is, then usage falls
    trace, levels = [(0.95, True)] * 8 + [(0.8, False)] * 4 + [(0.5, False)] * 8, []
    stalls = 0
    for usage, held in trace:  # a scripted view: the ladder alone (no running request to act on)
        stalls += held
        actions = controller.before_step(replace(core.kv.controller_view(), usage=usage, memory_stalls=stalls))
        levels.append(controller.level)
        assert all(isinstance(action, SpillPrefixes) for action in actions)  # nobody runs: only the spill rung acts
    assert levels[:8] == [0, 1, 1, 2, 2, 3, 3, 3]  # one rung every two steps, at most three
    assert levels[8:12] == [3, 3, 3, 3]  # between the watermarks: it holds (hysteresis)
    assert levels[12:] == [2, 2, 1, 1, 0, 0, 0, 0]  # down one rung every two steps


def _staggered(core, first, second, steps=3):
    """`first` alone (memory to spare: it keeps everything), then `second` once it decodes."""
    core.add(first)
    for _ in range(steps):
        core.step()
    assert not first.prefilling and first.kv_choice.reason == "spare"
    _run(core, [second])


def test_pressure_quantizes_a_running_request_and_counts_it(llama):
    core, controller = _engine(llama, num_blocks=30, steps_per_rung=1, low_watermark=0.2)
    first, second = _request(core, 64, 40, "chat", seed=1), _request(core, 64, 40, "chat", seed=2)
    _staggered(core, first, second)
    assert second.kv_choice.reason == "pressure" and second.kv.quant is not None
    assert first.kv is not None and first.kv.quant is not None  # quantized while it ran
    assert first.kv_choice.reason == "pressure" and first.kv_choice.mix == "int8"
    assert controller.decisions.total("quantize") >= 1
    assert controller.decisions.bytes_freed["quantize"] > 0
    assert controller.decisions.counts[("choose", "spare")] == 1


def test_compress_rung_caps_an_unquantized_request(llama):
    core, controller = _engine(llama, num_blocks=30, steps_per_rung=1, low_watermark=0.2, allowed_quants=())
    first, second = _request(core, 64, 40, "retrieval", seed=1), _request(core, 64, 40, "retrieval", seed=2)
    _staggered(core, first, second)
    assert controller.decisions.total("compress") >= 1
    assert first.kv is not None and first.kv.max_tokens is not None and first.kv.quant is None
    assert first.kept_score is not None and 0 <= first.kept_score <= 1
    assert controller.decisions.bytes_freed["compress"] > 0
    assert not any(Place.QUANTIZED in r.blocks.places for r in (first, second))


def test_auto_without_a_controller_is_refused(llama):
    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=32))
    with pytest.raises(ValueError, match="needs the adaptive controller"):
        core.make_request([5, 6, 7], SamplingParams(max_tokens=2), kv_auto="auto")


def test_llm_auto_uses_the_profile_and_a_budget(llama, tmp_path):
    from kvwise.engine.llm import LLM
    from kvwise.util.fingerprint import weights_fingerprint

    profile = _profile()
    profile.fingerprint = weights_fingerprint(llama)
    path = profile.save(tmp_path / "profile.json")
    llm = LLM(llama, CacheConfig(block_size=4), kv="auto", kv_budget_bytes=1 << 20, kv_profile_path=str(path))
    token_bytes = 2 * 3 * 2 * 16 * 4  # layers x kv heads x head size x float32, keys and values
    assert llm.cache_config.num_blocks == int((1 << 20) * 0.7) // (token_bytes * 4)
    prompts = [random_ids(1, 60, seed=s)[0].tolist() for s in range(2)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(output.requests[0].kv_choice.klass == "chat" for output in outputs)
    explicit = llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False, kv=Mix("snapkv", 0.5))
    assert explicit[0].requests[0].kv_choice is None  # its own settings win
    with pytest.raises(ValueError, match="kv must be None or 'auto'"):
        LLM(llama, kv="snapkv")
    with pytest.raises(ValueError, match="fewer than the longest request"):
        LLM(llama, kv_budget_bytes=1000)


def test_a_kvzip_pass_that_cannot_borrow_now_waits_instead_of_failing(llama):
    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=40, prefix_caching=False, swap_space_bytes=0))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    holder = core.make_request(random_ids(1, 80, seed=1)[0].tolist(), params)  # holds 28 of the 40 blocks at the end
    core.add(holder)
    for _ in range(3):
        core.step()
    compressing = core.make_request(random_ids(1, 40, seed=2)[0].tolist(), params, kv=Mix("kvzip", 0.5))
    _run(core, [compressing])  # its pass needs ~20 blocks more than its own: more than the pool has free
    assert compressing.error is None and len(compressing.output) == 30 and holder.error is None
    assert compressing.preemptions >= 1  # it went back to the queue and was computed again


def test_the_controller_answers_with_actions_and_the_manager_carries_them_out(llama):
    """The protocol: before_step reads a view and returns actions; nothing changes until the
    manager executes one, and its outcome comes back in the next view."""
    core, controller = _engine(llama, num_blocks=30, steps_per_rung=1, low_watermark=0.2)
    first = _request(core, 64, 40, "chat", seed=1)
    core.add(first)
    for _ in range(3):
        core.step()
    assert first.kv is None and first.kv_choice.reason == "spare"
    controller.level = 1  # the quantize rung in force
    view = core.kv.controller_view(core.scheduler.running, (core.scheduler.memory_stalls + 1, 0))
    actions = controller.before_step(view)
    assert [type(action) for action in actions] == [AssignMix] and actions[0].request is first
    assert actions[0].quantize_now and first.kv is None  # asked for, not done
    outcome = core.kv.execute(actions[0])
    assert outcome.error is None and outcome.freed_bytes > 0 and first.kv.quantizer is not None
    assert first.kv_choice is actions[0].label
    controller.before_step(core.kv.controller_view(core.scheduler.running, outcomes=[outcome]))
    assert controller.decisions.bytes_freed["quantize"] == outcome.freed_bytes
    _run(core, [])
