"""`kvwise bench decode`: each point's step and attention time, its bytes, and the report."""

from __future__ import annotations

import json

import pytest

from kvwise.bench.decode import DecodeConfig, _against_full, markdown, measure_point, memory_bandwidth, plot_decode
from tests.conftest import random_ids

pytestmark = pytest.mark.timeout(300)


def test_a_point_times_decode_steps_and_counts_the_kv_held(llama):
    config = DecodeConfig(steps=3, warmup=1)
    prompts = [random_ids(1, 120, seed=seed)[0].tolist() for seed in range(3)]
    rows = [measure_point(llama, None, prompts, form, config) for form in ("full", "int8", "snapkv@0.5")]
    for row in rows:
        assert 0 < row["attention_s"] < row["step_s"]
    full, int8, evicted = (row["kv_bytes"] for row in rows)
    assert int8 < full and evicted < 0.7 * full  # what each form holds, as the manager counts it
    results = _against_full(rows, "float32", 120, 3, weights=1000, bandwidth=1e10)
    assert results[0]["step_vs_full"] == 1.0 and results[0]["attention_vs_full"] == 1.0
    assert results[1]["attention_bytes_per_s"] == int8 / rows[1]["attention_s"]


def test_bad_settings_are_refused_before_any_model_loads():
    with pytest.raises(ValueError, match="full"):
        DecodeConfig(forms=("int8",))
    with pytest.raises(ValueError, match="unknown dtype"):
        DecodeConfig(dtypes=("float33",))
    with pytest.raises(ValueError):
        DecodeConfig(forms=("full", "int9"))
    with pytest.raises(ValueError, match="steps"):
        DecodeConfig(steps=0)


def test_copy_bandwidth_is_bytes_over_seconds():
    import torch

    assert 1e8 < memory_bandwidth(torch.device("cpu"), 8 << 20, repeats=2) < 1e13


def test_the_report_has_a_row_per_point_and_a_plot(tmp_path):
    rows = [
        {"form": form, "step_s": step, "attention_s": step / 2, "kv_bytes": 10**8 // scale}
        for form, step, scale in (("full", 0.2, 1), ("int8", 0.1, 4))
    ]
    results = _against_full(rows, "float32", 6000, 8, weights=5 * 10**8, bandwidth=2e10)
    config = {"steps": 4, "warmup": 1, "bandwidth_bytes": 256 << 20, "forms": ["full", "int8"], "model": None}
    system = {"kvwise": "0", "torch": "2", "device": "cpu", "hardware": "test"}
    report = {"config": config, "system": system, "bandwidth_bytes_per_s": 2e10, "results": results}
    table = markdown(report)
    assert "| float32 | 6000 | 8 | int8 | 100.0 | 0.50x | 50.0 | 0.50x | 25.0 | 0.5 | 2% |" in table
    json.dumps(report)
    plot_decode(report, tmp_path / "decode.png")
    assert (tmp_path / "decode.png").stat().st_size > 1000
