"""The throughput workload is the one BENCHMARKS defines: lengths, slices, order."""

from __future__ import annotations

import random

import pytest

from kvwise.bench.throughput import ThroughputConfig, markdown, workload


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
