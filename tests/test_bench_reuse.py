"""Pieces of `kvwise bench reuse` that run in milliseconds; the whole bench runs in results/."""

from __future__ import annotations

import pytest

from kvwise.bench.reuse import ReuseConfig, markdown, measure_lookup


def test_lookup_cost_per_token_does_not_grow_with_the_tree():
    """A lookup walks one path of the tree: its cost per matched token is the same on a tree 8x
    larger (a scan over the tree's blocks would be 8x dearer). A ratio measured in one test, so
    a loaded machine slows both sides alike; 3x leaves room for noise and stays far from 8x."""
    small = min(measure_lookup(tree_blocks=256, block_size=16, seed=seed) for seed in (0, 1))
    large = min(measure_lookup(tree_blocks=2048, block_size=16, seed=seed) for seed in (0, 1))
    assert 0 < large < 3 * small, (small, large)


def test_bad_reuse_configs():
    with pytest.raises(ValueError, match="shared_fraction"):
        ReuseConfig(shared_fraction=1.5)
    with pytest.raises(ValueError, match="requests >= 2"):
        ReuseConfig(requests=1)


def test_report_states_speedup_against_the_bound():
    report = {
        "config": {"model": None, "dtype": "bfloat16", "block_size": 16, "tree_blocks": 100, "restore_tokens": 2000},
        "system": {"kvwise": "0", "device": "cpu", "hardware": "x"},
        "lookup_us_per_token": 0.1,
        "restore_speedup": {"host": 90.0, "disk": 20.0},
        "rag": {
            "requests": 4,
            "prompt_tokens": 100,
            "hit_rate": 0.5,
            "ttft_p50_s_off": 2.0,
            "ttft_p50_s_on": 1.25,
            "ttft_p99_s_off": 2.5,
            "ttft_p99_s_on": 2.0,
            "speedup": 1.6,
            "bound": 2.0,
        },
    }
    text = markdown(report)
    assert (
        "host 90.0x, disk 20.0x" in text
        and "p50 speedup 1.60x; bound 1/(1 - hit rate) = 2.00x (0.80 of the bound)" in text
    )


def test_restore_is_timed_against_a_copy_and_a_raw_read_of_the_same_bytes(llama, tmp_path):
    from kvwise.bench.reuse import measure_restore, restore_lines
    from kvwise.tiers.disk import DiskTier
    from kvwise.tiers.host import HostTier
    from tests.conftest import random_ids

    ids = random_ids(1, 65, seed=3)
    tiers = {"host": HostTier(64 << 20), "disk": DiskTier(tmp_path / "disk")}
    rows = measure_restore(llama, ids, 16, tiers, repeats=2)
    for name, row in rows.items():
        assert row["bytes"] > 0 and row["pool_seconds"] > 0 and row["copy_seconds"] > 0, name
        assert row["library_seconds"] > 0 and row["recompute_seconds"] > 0
    assert rows["host"]["raw_read_seconds"] is None and rows["disk"]["raw_read_seconds"] > 0
    table = "\n".join(restore_lines(rows))
    assert "| host |" in table and "| disk |" in table and "pool / raw read" in table
