"""`kvwise bench ppl` end to end on the embedded model, cut down to seconds."""

from __future__ import annotations

import json

import pytest

from kvwise.bench.ppl import HF_PEERS, PplConfig, run_ppl
from kvwise.bench.ppl_report import markdown_table

pytestmark = pytest.mark.smollm


def test_ppl_bench_writes_every_field(smollm, tmp_path, monkeypatch):
    monkeypatch.setitem(HF_PEERS, "quanto", HF_PEERS["quanto"][:1])  # one peer configuration is enough here
    config = PplConfig(
        tokens=256,
        chunk=64,
        quants=["kivi4", "int8"],
        policies=["h2o"],
        budgets=[80],
        mixes=["h2o@max=80+kivi2"],
        repeats=1,
        peers=["quanto"],
    )
    report = run_ppl(config, tmp_path)
    saved = json.loads((tmp_path / "ppl.json").read_text())
    assert saved["workload"] == "ppl" and set(saved["system"]) >= {"kvwise", "torch", "transformers", "device"}
    results = saved["results"]
    assert [row["system"] for row in results][:3] == ["kvwise", "kvwise", "kvwise"]
    assert {row["system"] for row in results} >= {"kvwise", "hf-quanto"}
    for row in results:
        for name in ("config", "ppl", "ppl_ratio", "kv_bytes", "full_kv_bytes", "full16_kv_bytes", "tokens_per_second"):
            assert name in row, name
        assert row["ppl"] > 1 and row["tokens_per_second"] > 0
    full, kivi4, int8 = results[0], results[1], results[2]
    assert full["ppl_ratio"] == 1.0 and full["config"]["quant"] is None
    # most of 256 tokens sit in kivi4's full-precision residual window; int8 has none
    assert kivi4["config"]["quant"] == "kivi4" and kivi4["kv_bytes"] < 0.8 * full["kv_bytes"]
    assert int8["kv_bytes"] < 0.6 * full["kv_bytes"] and abs(int8["ppl_ratio"] - 1) < 0.01
    budgeted = [row for row in results if row["config"].get("max_kv_tokens") == 80]
    assert len(budgeted) == 2 and all(row["kv_bytes"] < full["kv_bytes"] for row in budgeted)
    assert "| kvwise | kivi4 |" in markdown_table(report)
    assert (tmp_path / "ppl.png").exists() and (tmp_path / "ppl.md").exists()
    assert not (tmp_path / "ppl.partial.jsonl").read_text() == ""
