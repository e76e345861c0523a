"""`kvwise bench isolation` on the embedded model, cut down for CI (the bench runs 200 trials per
class): isolated tenants get no hit and a timing probe sees nothing, while the same probe reads
shared hits at once (the positive control); fair prefix shares keep a flooded tenant's hits."""

from __future__ import annotations

import json

import pytest

from kvwise.bench.isolation import IsolationConfig, roc_auc, run_isolation

pytestmark = pytest.mark.smollm


def test_roc_auc():
    assert roc_auc([2, 3], [0, 1]) == 1.0 and roc_auc([0, 1], [2, 3]) == 0.0 and roc_auc([1], [1]) == 0.5


def test_isolation_bench(tmp_path):
    config = IsolationConfig(trials=20, prefix_tokens=128, victim_repeats=3, flood_pool_blocks=64, flood_factor=1.5)
    run_isolation(config, tmp_path)
    report = json.loads((tmp_path / "isolation.json").read_text())
    probes = {row["mode"]: row for row in report["results"]["probes"]}
    assert probes["isolated"]["target_hits"] == 0 and probes["isolated"]["control_hits"] == 0
    assert probes["isolated"]["auc"] <= 0.8  # 20 trials per class; the bench's 200 hold it to 0.6
    assert probes["shared"]["target_hits"] == 20 and probes["shared"]["auc"] >= 0.9  # the probe can see
    assert probes["shared-padded"]["target_hits"] == 20 and probes["shared-padded"]["auc"] <= 0.8
    flood = {row["fair_prefix_shares"]: row["victim_hit_rate"] for row in report["results"]["flood"]}
    assert flood[True] >= 0.9 and flood[False] < flood[True]
    assert (tmp_path / "isolation.md").exists() and (tmp_path / "isolation_ttft.png").exists()
