"""`kvwise bench niah --paths library,engine`: both paths in one report, trial by trial, with
policy options and byte budgets on the engine as on the library."""

from __future__ import annotations

import json

import pytest

import kvwise.bench.niah_engine as niah_engine
from kvwise.bench.niah import NiahConfig, run_niah
from tests.tiny_chars_model import save_tiny_llama

pytestmark = pytest.mark.timeout(300)


def test_both_paths_run_every_cell_and_the_engine_gets_policy_options(tmp_path, monkeypatch):
    seen = []
    settings = niah_engine.Mix

    def recording(*args, **kwargs):
        seen.append(dict(kwargs.get("options", ())))
        return settings(*args, **kwargs)

    monkeypatch.setattr(niah_engine, "Mix", recording)
    config = NiahConfig(
        model=str(save_tiny_llama(tmp_path / "model")),
        policies=["full", "snapkv:window_size=8"],
        ratios=[0.5],
        lengths=[120],
        depths=[0.5],
        trials_per_depth=2,
        budget_bytes=[0.2],
        mixes=["snapkv:window_size=8+kivi4"],
        paths=["library", "engine"],
    )
    report = run_niah(config, tmp_path / "out")
    paths = [row["path"] for row in report["results"]]
    # cells interleaved trial by trial: each cell's library row, then its engine row
    assert paths == ["library", "engine"] * (len(paths) // 2) and len(paths) == 2 * 3 * 2
    assert {"window_size": 8} in seen  # the options reach the engine's settings, for ratio and budget cells
    budget_rows = [row for row in report["results"] if row["budget"] is not None]
    engine_ratio = {row["ratio"] for row in budget_rows if row["path"] == "engine"}
    library_ratio = {row["ratio"] for row in budget_rows if row["path"] == "library"}
    # a quantized mix keeps whole pages on both paths (`fill_pages`), so a budget sets one ratio
    # and both paths hold the same number of tokens, trial by trial
    assert engine_ratio == library_ratio and len(engine_ratio) == 1
    kept = [row["compressed_tokens"] for row in budget_rows]
    assert kept[0::2] == kept[1::2]
    table = (tmp_path / "out" / "niah.md").read_text()
    assert "| engine:snapkv:window_size=8 |" in table and "| library:snapkv:window_size=8 |" in table
    assert "| engine:snapkv:window_size=8+kivi4 |" in table and "paths: library, engine" in table
    saved = json.loads((tmp_path / "out" / "niah.json").read_text())
    assert saved["config"]["paths"] == ["library", "engine"]
