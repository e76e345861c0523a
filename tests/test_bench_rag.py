"""`kvwise bench rag` end to end on SmolLM2 at a tiny size: the JSON schema, reuse on and off."""

from __future__ import annotations

import json

import pytest

from kvwise.bench.rag import RagConfig, run_rag

pytestmark = pytest.mark.smollm


def test_rag_bench_writes_reuse_on_and_off(tmp_path):
    config = RagConfig(
        requests=4,
        documents=1,
        document_tokens=(40, 60),
        system_prompt_tokens=40,
        question_tokens=(5, 10),
        output_tokens=2,
        concurrency=2,
        shared_fraction=1.0,
    )
    run_rag(config, tmp_path)
    report = json.loads((tmp_path / "rag.json").read_text())
    rows = {(row["system"], row["config"]["reuse"]): row for row in report["results"]}
    assert set(rows) == {("hf-sequential", False), ("kvwise", False), ("kvwise", True)}
    for row in rows.values():
        for key in ("tokens_per_second", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "hit_rate", "peak_kv_bytes"):
            assert row[key] >= 0
    assert rows["kvwise", False]["hit_rate"] == 0 and rows["kvwise", True]["hit_rate"] > 0.3  # one shared document
    assert report["summary"]["bound"] > 1 and "TTFT p50 with reuse" in (tmp_path / "rag.md").read_text()


def test_rag_config_errors():
    with pytest.raises(ValueError, match="unknown systems"):
        RagConfig(systems=("vllm",))
    with pytest.raises(ValueError, match="shared_fraction"):
        RagConfig(shared_fraction=2)
