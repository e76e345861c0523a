"""The throughput workload is the one BENCHMARKS defines: lengths, slices, order."""

from __future__ import annotations

import random

import pytest

from kvwise.bench.throughput import ThroughputConfig, markdown, versus_vllm, workload
from kvwise.engine.step_profile import PARTS


class WordTokenizer:
    def __call__(self, text, add_special_tokens=False):
        class Encoded:
            input_ids = list(range(len(text.split())))

        return Encoded()


def test_prompts_are_consecutive_slices_with_seeded_lengths():
    prompts = workload(WordTokenizer(), ThroughputConfig())
    rng = random.Random(7)
    lengths = [rng.randint(256, 1024) for _ in range(32)]
    assert [len(p) for p in prompts] == lengths
    assert prompts[0][0] == 0 and prompts[1][0] == lengths[0]  # slice after slice from token 0


def test_bad_config_and_report():
    with pytest.raises(ValueError, match="min_prompt"):
        ThroughputConfig(min_prompt=10, max_prompt=5)
    row = {
        "tokens_per_second": 20.0,
        "wall_seconds": 1.0,
        "ttft_p50_s": 0.5,
        "ttft_p99_s": 0.9,
        "tpot_p50_s": 0.05,
        "hit_rate": 0.0,
        "peak_kv_bytes": 10,
    }
    report = {
        "config": {"requests": 2, "min_prompt": 1, "max_prompt": 2, "new_tokens": 4, "model": None},
        "system": {"kvwise": "0", "device": "cpu", "hardware": "x"},
        "prompt_tokens": 3,
        "results": [{**row, "system": "hf-sequential"}, {**row, "system": "kvwise", "tokens_per_second": 70.0}],
    }
    assert "| kvwise | 70.00 | 3.50x |" in markdown(report)


def test_the_report_sets_kvwise_beside_each_vllm_row_and_shows_the_step_profile():
    row = {"wall_seconds": 1.0, "ttft_p99_s": 0.9, "hit_rate": 0.0, "peak_kv_bytes": 10, "outputs": [[1, 2], [3, 4]]}
    vllm = {
        **row,
        "system": "vllm",
        "tokens_per_second": 50.0,
        "ttft_p50_s": 0.5,
        "tpot_p50_s": 0.04,
        "peak_kv_bytes": None,
        "outputs": [[1, 2], [3, 5]],
        "top_logprobs": [[[-0.1, -2.0], [-0.1, -2.0]], [[-0.1, -2.0], [-0.6931, -0.6935]]],
        "config": {
            "vllm_version": "0.32.0",
            "effective": {"max_num_seqs": 256, "max_num_batched_tokens": 4096},
            "threads_bind": "0,1",
        },
    }
    parts = {part: {"seconds": 1.0, "share": 0.125} for part in PARTS}
    profile = {"steps": 3, "seconds": 8.0, "tokens": {"prefill": 10, "decode": 4}, "parts": parts, "wall_seconds": 8.5}
    ours = {**row, "system": "kvwise", "tokens_per_second": 60.0, "ttft_p50_s": 0.25, "tpot_p50_s": 0.05}
    results = [vllm, {**ours, "profile": profile}]
    report = {
        "config": {"requests": 2, "min_prompt": 1, "max_prompt": 2, "new_tokens": 2, "model": None},
        "system": {"kvwise": "0", "device": "cpu", "hardware": "x"},
        "prompt_tokens": 3,
        "results": results,
        "versus_vllm": versus_vllm(results),
    }
    [versus] = report["versus_vllm"]
    assert versus["tokens_per_second_ratio"] == pytest.approx(1.2) and versus["ttft_p50_ratio"] == pytest.approx(0.5)
    assert versus["agreement"]["same"] == 1 and versus["agreement"]["divergences_at_near_ties"] == 1
    text = markdown(report)
    assert "| vllm | 50.00 |" in text and "| preallocated |" in text
    assert "`kvwise` against `vllm`: output tok/s 1.20x, TTFT p50 0.50x, TPOT p50 1.25x" in text
    assert "same in 1 of 2 requests, 1 of the 1 divergences at a near-tie" in text
    assert "max_num_seqs=256, max_num_batched_tokens=4096" in text and "CPUs 0,1" in text
    assert "| linear.prefill | 1.00 | 12.5% |" in text and "3 steps, 10 prefill and 4 decode tokens" in text
