"""`kvwise bench isolation` on the embedded model, cut down for CI (the bench runs 200 trials per
class): isolated tenants get no hit and a timing probe sees nothing, while the same probe reads
shared hits at once (the positive control); fair prefix shares keep a flooded tenant's hits.
And the shared timing pad's cost estimate, which must follow typical steps, not slowed ones."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from kvwise.bench.isolation import IsolationConfig, roc_auc, run_isolation
from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore


def test_roc_auc():
    assert roc_auc([2, 3], [0, 1]) == 1.0 and roc_auc([0, 1], [2, 3]) == 0.0 and roc_auc([1], [1]) == 0.5


def test_pad_follows_typical_steps(llama, monkeypatch):
    """Misses of 264 tokens take 0.30 s and hits (8 tokens after 256 cached) 0.05 s, but a third
    of the steps run 5x slower (other work on the machine), and a miss after the engine sat idle
    takes 0.03 s more. A hit's pad is a typical miss minus what its own step took: 0.25 s after a
    typical hit step. A least-squares line through the same steps (the pad before) said 0.48 s."""
    clock = [0.0]  # the engine's clock, advanced by each synthetic step and the idle time before it
    monkeypatch.setattr("kvwise.engine.core.time.perf_counter", lambda: clock[0])
    core = EngineCore(llama, cache_config=CacheConfig(num_blocks=64), cpu_kernel=False)

    def step(start: int, seconds: float, idle: float = 0.005, decodes: int = 0) -> None:
        clock[0] += idle + seconds
        chunks = [SimpleNamespace(start=start, end=264)] + [SimpleNamespace(start=300, end=301)] * decodes
        core._measure_prefill(chunks, seconds)

    assert core.hit_pad_seconds(256) == 0.0  # nothing timed yet
    rng = random.Random(0)
    for index in range(64):
        slowdown = 5.0 if rng.random() < 1 / 3 else rng.uniform(0.98, 1.02)
        if index % 2 == 0:
            step(256, 0.05 * slowdown)
        elif index % 4 == 1:
            step(0, 0.30 * slowdown)
        else:
            step(0, 0.33 * slowdown, idle=0.3)
    step(256, 0.05)
    assert core.hit_pad_seconds(256) == pytest.approx(0.25, rel=0.05)
    assert core.hit_pad_seconds(0) == 0.0  # no hit, no pad
    step(256, 0.06, idle=0.3)  # after idling, a miss would have been slower too
    assert core.hit_pad_seconds(256) == pytest.approx(0.27, rel=0.05)
    step(256, 0.20)  # a slowed hit step is padded up to a typical miss, no further
    assert core.hit_pad_seconds(256) == pytest.approx(0.10, abs=0.015)
    step(256, 0.08, decodes=4)  # decodes in the step: the saved tokens' modelled cost alone
    assert core.hit_pad_seconds(256) == pytest.approx(0.25, rel=0.05)


@pytest.mark.smollm
def test_isolation_bench(tmp_path):
    config = IsolationConfig(
        trials=20,
        prefix_tokens=128,
        victim_repeats=3,
        flood_pool_blocks=64,
        flood_factor=1.5,
        hit_probes=16,
        hit_probe_concurrency=16,
    )
    run_isolation(config, tmp_path)
    report = json.loads((tmp_path / "isolation.json").read_text())
    probes = {row["mode"]: row for row in report["results"]["probes"]}
    assert probes["isolated"]["target_hits"] == 0 and probes["isolated"]["control_hits"] == 0
    assert probes["isolated"]["auc"] <= 0.8  # 20 trials per class; the bench's 200 hold it to 0.6
    assert probes["shared"]["target_hits"] == 20 and probes["shared"]["auc"] >= 0.9  # the probe can see
    assert probes["shared-padded"]["target_hits"] == 20 and probes["shared-padded"]["auc"] <= 0.8
    # concurrent hit probes: none cross isolated tenants, and every one hits when the prefix is
    # shared, so the victim's prefixes were still cached when probed
    assert [probes[mode]["hit_probes"] for mode in probes] == [16, 16, 16]
    assert probes["isolated"]["hit_probe_hits"] == 0
    assert probes["shared"]["hit_probe_hits"] == 16 and probes["shared-padded"]["hit_probe_hits"] == 16
    flood = {row["fair_prefix_shares"]: row["victim_hit_rate"] for row in report["results"]["flood"]}
    assert flood[True] >= 0.9 and flood[False] < flood[True]
    assert (tmp_path / "isolation.md").exists() and (tmp_path / "isolation_ttft.png").exists()
    assert "| isolated | 0/20 | 0/20 | 0/16 |" in (tmp_path / "isolation.md").read_text()
