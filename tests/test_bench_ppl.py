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


def test_the_engine_path_scores_the_same_tokens_through_the_decode_path(smollm, tmp_path):
    config = PplConfig(
        tokens=192,
        chunk=64,
        quants=["int8"],
        policies=["h2o"],
        budgets=[80],
        mixes=[],
        repeats=1,
        peers=[],
        paths=["library", "engine"],
    )
    with_peers = PplConfig(peers=["quanto"], paths=["library", "engine"])
    assert {entry["system"] for entry in with_peers.systems() if entry["path"] == "engine"} == {"kvwise"}
    report = run_ppl(config, tmp_path)
    kvwise = [row for row in report["results"] if row["system"] == "kvwise"]
    rows = {(row["path"], row["config"]["policy"], row["config"]["quant"]): row for row in kvwise}
    full, int8, h2o = rows["engine", "full", None], rows["engine", "full", "int8"], rows["engine", "h2o", None]
    assert full["ppl_ratio"] == 1.0
    # the same tokens, the same model: the full caches agree up to bfloat16 rounding
    assert abs(full["ppl"] / rows["library", "full", None]["ppl"] - 1) < 0.02
    assert int8["kv_bytes"] < 0.6 * full["kv_bytes"] and abs(int8["ppl_ratio"] - 1) < 0.01
    # the cap evicts while the rest is decoded: fewer bytes, a worse score
    assert h2o["kv_bytes"] < 0.7 * full["kv_bytes"] and h2o["ppl_ratio"] > 1
    assert "| kvwise (engine) | int8 |" in markdown_table(report)
    with pytest.raises(ValueError, match="--paths takes one or both of library, engine"):
        PplConfig(paths=["gpu"])
