"""Equal-bytes NIAH: budgets checked, the ratio that holds a budget, the report's table and front."""

from __future__ import annotations

import pytest

from kvwise.bench.byte_budget import ByteSizer, budget_mix, check_budgets
from kvwise.bench.commands import specs
from kvwise.bench.niah import LibraryTrials, NiahConfig, policy_options
from kvwise.bench.niah_report import budget_table, summarize, summarize_budgets
from kvwise.hf.cache import KVWiseCache, full_kv_bytes
from tests.conftest import random_ids

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("kvzap_surrogate")]


@pytest.mark.parametrize("budget", [0.0, -0.1, 1.5])
def test_a_budget_outside_zero_one_is_refused(budget):
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        check_budgets([0.05, budget])
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        NiahConfig(budget_bytes=[budget])


def test_budget_cells_need_mixes_without_ratios_and_the_library():
    assert NiahConfig(budget_bytes=[0.05]).mixes[0] == "kvzip+kivi2"  # the default mixes
    with pytest.raises(ValueError, match="leave out '@...'"):
        budget_mix("kvzip@0.9+kivi2")
    with pytest.raises(ValueError, match="unknown component"):
        NiahConfig(budget_bytes=[0.05], mixes=["kvzop+kivi2"])
    with pytest.raises(ValueError, match="give --budget-bytes too"):
        NiahConfig(mixes=["kvzip+kivi2"])
    with pytest.raises(ValueError, match="--paths takes one or both of library, engine"):
        NiahConfig(budget_bytes=[0.05], paths=["engine", "server"])
    with pytest.raises(ValueError, match="each once"):
        NiahConfig(paths=["engine", "engine"])


def test_the_solver_pays_for_padded_pages_in_a_byte_budget(llama):
    """Where a head's last page is padded (half a page on average), one budget keeps fewer tokens
    than where nothing pads; the solver charges that half page."""
    sizer = ByteSizer(llama)
    library = sizer.solve(budget_mix("snapkv+kivi4"), 400, 0.1)
    engine = sizer.solve(budget_mix("snapkv+kivi4"), 400, 0.1, page_tokens=32)
    assert 0 < library.ratio < engine.ratio < 1


def test_policies_take_options_and_errors_name_what_was_written():
    config = NiahConfig(policies=["full", "kvzip:recent_window=32"], ratios=[0.9])
    assert config.cells() == [("full", 0.0), ("kvzip:recent_window=32", 0.9)]
    assert policy_options("kvzip:recent_window=32") == ("kvzip", (("recent_window", 32),))
    with pytest.raises(ValueError, match="unknown policy 'kvzop'"):
        NiahConfig(policies=["kvzop"])
    with pytest.raises(ValueError, match="has no option bogus"):
        NiahConfig(policies=["kvzip:bogus=1"])
    with pytest.raises(ValueError, match="--quant"):
        NiahConfig(policies=["kvzip+kivi4"])
    # on the command line, options after the first continue their policy or mix
    assert specs("full,kvzip:recent_window=64,pool_kernel=3,kvzap") == [
        "full",
        "kvzip:recent_window=64,pool_kernel=3",
        "kvzap",
    ]
    assert specs("kvzip:recent_window=64,pool_kernel=3+kivi4,lowrank:r=32+kivi2") == [
        "kvzip:recent_window=64,pool_kernel=3+kivi4",
        "lowrank:r=32+kivi2",
    ]


@pytest.mark.parametrize("mix", ["streaming_llm+kivi2", "kvzap+kivi2", "snapkv+int8", "kvzap"])
def test_the_solved_ratio_holds_the_budget(llama, mix):
    tokens, budget, parsed, sizer = 200, 0.1, budget_mix(mix), ByteSizer(llama)
    page = LibraryTrials(llama, None).page_tokens(parsed.quant)
    solved = sizer.solve(parsed, tokens, budget, page)
    assert solved.ratio is not None and 0 < solved.ratio < 1
    cache = KVWiseCache(llama, parsed.policy, solved.ratio, quant=parsed.quant)
    cache.compress_context(random_ids(1, tokens, seed=4))
    held = cache.nbytes() / full_kv_bytes(llama, tokens, 2)
    # at the budget, not far under it: a quantized head keeps whole pages, half a page more than
    # the ratio on average (the solver pays for that half), so up to half a page either way
    rounding = page / 2 * sizer.coefficients(parsed.quant)[1] / full_kv_bytes(llama, tokens, 2)
    assert 0.85 * budget - rounding <= held <= 1.005 * budget + rounding, (held, rounding)


def test_a_mix_that_cannot_reach_a_budget_says_why(llama):
    sizer = ByteSizer(llama)
    alone = sizer.solve(budget_mix("kivi2"), 200, 0.01)
    assert alone.ratio is None and "without eviction" in alone.note
    assert sizer.solve(budget_mix("full"), 200, 1.0).ratio is None  # float32: twice a 16-bit cache
    tiny = sizer.solve(budget_mix("snapkv"), 200, 0.0001)
    assert tiny.ratio is None and "less than one token" in tiny.note
    assert sizer.solve(budget_mix("kivi4"), 200, 0.9).ratio == 0.0  # fits without evicting


def _row(mix, budget, correct, kv16):
    return {
        "policy": mix,
        "ratio": 0.9,
        "budget": budget,
        "length": 1000,
        "depth": 0.0,
        "trial": 0,
        "correct": correct,
        "kv_bytes": kv16 * 50,
        "full_kv_bytes": 100,
        "full16_kv_bytes": 50,
        "seconds": 1.0,
    }


def test_the_equal_bytes_table_marks_the_best_mix_the_front_and_the_skipped():
    results = [
        _row("kvzip+kivi2", 0.02, True, 0.019),
        _row("snapkv+kivi2", 0.02, False, 0.018),
        _row("kvzip+kivi2", 0.05, True, 0.048),
        _row("kvzip", 0.05, True, 0.049),
        {**_row("full", None, True, 2.0), "budget": None, "ratio": 0.0},
    ]
    report = {"results": results, "skipped": [{"mix": "kivi2", "budget": 0.02, "why": "holds 0.160 without eviction"}]}
    summary = {(row["mix"], row["budget"]): row for row in summarize_budgets(results)}
    assert set(summary) == {("kvzip+kivi2", 0.02), ("snapkv+kivi2", 0.02), ("kvzip+kivi2", 0.05), ("kvzip", 0.05)}
    assert [row["policy"] for row in summarize(results)] == ["full"]  # budget rows stay out of the ratio table
    table = budget_table(report)
    assert "| kvzip+kivi2 | **1/1, kv16 0.0480" in table  # best at 0.05: equal accuracy, fewer bytes
    assert "**1/1, kv16 0.0190" in table and "| snapkv+kivi2 |  | 0/1" in table
    assert "skipped: holds 0.160 without eviction" in table
    # the cheapest cell is on the front whatever it scores; then each that scores more
    assert "front (accuracy against bytes): snapkv+kivi2 at 0.0180 -> 0/1, kvzip+kivi2 at 0.0190 -> 1/1" in table
