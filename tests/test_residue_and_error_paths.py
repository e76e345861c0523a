"""No KV outlives its owner, and no error path leaks: host-tier entries read as zeros after
eviction and delete (raw storage), and a swap that fails on the way out or in leaves the request
recomputed correctly with every block back."""

from __future__ import annotations

import pytest
import torch

from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.sampling import SamplingParams
from kvwise.tiers.host import HostTier
from tests.conftest import random_ids
from tests.test_engine_core import _run, assert_only_prefix_cache_holds_blocks


def test_host_tier_entries_are_zeroed_on_eviction_and_delete():
    tier = HostTier(capacity_bytes=2 * 64 * 4)
    tier.put(b"a", torch.full((64,), 7.0))
    tier.put(b"b", torch.full((64,), 8.0))
    raw_a, raw_b = tier._blocks[b"a"], tier._blocks[b"b"]  # the tier's own storage
    fetched = tier.get(b"a")
    tier.put(b"c", torch.full((64,), 9.0))  # evicts b (a was used more recently)
    assert torch.count_nonzero(raw_b) == 0 and b"b" not in tier._blocks
    tier.delete(b"a")
    assert torch.count_nonzero(raw_a) == 0
    assert torch.equal(fetched, torch.full((64,), 7.0))  # what a caller fetched is its own copy


@pytest.mark.parametrize("failing", ["swap_out", "swap_in"])
def test_a_failed_swap_recomputes_and_leaks_nothing(llama, monkeypatch, failing):
    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (9, 14, 11, 7)]
    params = SamplingParams(temperature=0, max_tokens=20)
    roomy = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=64, swap_space_bytes=0))
    expected = [roomy.make_request(p, params) for p in prompts]
    _run(roomy, expected)
    tight = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=16, swap_space_bytes=1 << 24))
    original = getattr(tight.kv._swap, failing)
    calls = {"n": 0}

    def broken(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("host memory refused")
        return original(*args, **kwargs)

    monkeypatch.setattr(tight.kv._swap, failing, broken)
    outputs = [tight.make_request(p, params) for p in prompts]
    _run(tight, outputs)
    assert calls["n"] >= 1 and tight.scheduler.preemptions > 0
    assert [r.output for r in outputs] == [r.output for r in expected]
    assert tight.kv.recomputed_blocks > 0 and tight.kv.stats().swap_used_bytes == 0
    assert_only_prefix_cache_holds_blocks(tight)


def test_swapped_out_host_copies_are_zeroed_when_dropped(llama):
    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=16, swap_space_bytes=1 << 24))
    request = core.make_request(random_ids(1, 9)[0].tolist(), SamplingParams(max_tokens=8))
    core.add(request)
    core.step()
    assert request.blocks
    swapped = core.kv._swap.swap_out(request.blocks.block_ids)
    assert torch.count_nonzero(swapped.keys) > 0
    core.kv._swap.drop(swapped)
    assert torch.count_nonzero(swapped.keys) == 0 and torch.count_nonzero(swapped.values) == 0
