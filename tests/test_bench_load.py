"""`kvwise bench load`, cut down: concurrent streams with hang-ups and cancellations against a live
server on a tiny model, with faults injected into its disk tier; every answer is a 200, and once
idle no block is held outside the prefix cache."""

from __future__ import annotations

import json

from kvwise.bench.load import LoadConfig, run_load
from tests.base_model import save_base_model


def test_load_bench_leaks_nothing(tmp_path):
    directory = save_base_model(tmp_path / "model", max_positions=512)
    config = LoadConfig(
        model=str(directory),
        clients=16,
        duration_seconds=8,
        hangup_fraction=0.3,
        cancel_fraction=0.2,
        tier_faults=True,
        num_blocks=160,  # small: prefix blocks spill to the faulty disk tier and come back
        max_tokens=16,
        prompt_words=(4, 40),  # a character tokenizer: 40 words fit its 512 positions
    )
    run_load(config, tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "load.json").read_text())["results"]["summary"]
    assert summary["requests"] >= 16 and summary["hung_up"] >= 1 and summary["cancelled"] >= 1
    assert set(summary["statuses"]) <= {"200", "cancelled"}, summary["statuses"]
    assert sum(summary["faults_injected"].values()) >= 4 and summary["tier"]["puts"] > 0
    assert summary["leaked_blocks"] == 0 and summary["prefix_locks"] == 0
    assert (tmp_path / "out" / "load.md").exists() and (tmp_path / "out" / "load_memory.png").exists()
