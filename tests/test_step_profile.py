"""`EngineCore.profiling`: the step's parts add up to its time, each part measures what it names,
and nothing stays attached afterwards."""

from __future__ import annotations

import time

import pytest

from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.sampling import SamplingParams
from kvwise.engine.step_profile import PARTS
from tests.conftest import random_ids


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _run(core: EngineCore, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for ids in prompts:
        core.add(core.make_request(ids, params))
    started = time.perf_counter()
    while core.has_work:
        core.step()
    return time.perf_counter() - started


@pytest.mark.timeout(120)
def test_the_parts_add_up_to_the_steps_and_name_what_ran(llama):
    core = EngineCore(llama, None, CacheConfig(num_blocks=64, prefix_caching=False))
    hooks_before = _hooks(llama)
    prompts = [random_ids(1, 40, seed)[0].tolist() for seed in range(3)]
    with core.profiling() as profile:
        wall = _run(core, prompts, new_tokens=6)
    summary = profile.summary()
    assert list(summary["parts"]) == list(PARTS)
    assert summary["steps"] > 0 and summary["tokens"] == {"prefill": 120, "decode": 15}  # 3 x 40, 3 x (6 - 1)
    assert 0 < summary["seconds"] <= wall  # the steps are all of the run but its loop
    assert sum(p["share"] for p in summary["parts"].values()) == pytest.approx(1.0)
    parts = summary["parts"]
    for part in ("linear.prefill", "linear.decode", "attention.prefill", "attention.decode", "sampling"):
        assert parts[part]["seconds"] > 0, part
    assert all(p["seconds"] >= 0 for p in parts.values())
    # the hooks and timers go with the profile: the next steps run as before
    assert _hooks(llama) == hooks_before and core.profile is None and core.runner.profile is None


@pytest.mark.timeout(120)
def test_a_decode_only_run_puts_its_linear_time_on_decode(llama):
    core = EngineCore(llama, None, CacheConfig(num_blocks=64, prefix_caching=False))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    core.add(core.make_request(random_ids(1, 30, 5)[0].tolist(), params))
    core.step()  # the prefill, before the profile
    with core.profiling() as profile:  # decode steps alone
        while core.has_work:
            core.step()
    parts, tokens = profile.summary()["parts"], profile.summary()["tokens"]
    assert tokens == {"prefill": 0, "decode": 4}
    assert parts["linear.decode"]["seconds"] > 0 and parts["linear.prefill"]["seconds"] == 0
    assert parts["attention.decode"]["seconds"] > 0 and parts["attention.prefill"]["seconds"] == 0
    with core.profiling() as idle:
        pass
    assert idle.summary()["steps"] == 0 and idle.summary()["seconds"] == 0  # nothing ran: no time, no division by zero
