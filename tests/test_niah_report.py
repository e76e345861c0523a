"""The NIAH report: Markdown summary and plots from a results list."""

from kvwise.bench.niah_report import markdown_table, summarize, write_niah_report


def fake_report():
    results = []
    for policy, ratio, seconds in (("full", 0.0, 2.0), ("snapkv", 0.9, 1.0)):
        for depth, correct in ((0.0, True), (1.0, policy == "full")):
            results.append(
                {
                    "policy": policy,
                    "ratio": ratio,
                    "length": 1000,
                    "depth": depth,
                    "trial": 0,
                    "mode": "agnostic",
                    "correct": correct,
                    "kv_bytes": 100 if policy == "full" else 10,
                    "full_kv_bytes": 100,
                    "full16_kv_bytes": 50,
                    "seconds": seconds,
                }
            )
    config = {
        "mode": "agnostic",
        "lengths": [1000],
        "depths": [0.0, 1.0],
        "trials_per_depth": 1,
        "seed": 0,
        "model": None,
    }
    system = {"kvwise": "0", "torch": "t", "transformers": "x", "device": "cpu", "hardware": "h"}
    return {"workload": "niah", "config": config, "system": system, "results": results}


def test_summary_counts_and_ratios():
    rows = {(row["policy"], row["ratio"]): row for row in summarize(fake_report()["results"])}
    assert rows[("snapkv", 0.9)]["correct"] == 1 and rows[("snapkv", 0.9)]["kv_fraction"] == 0.1
    table = markdown_table(fake_report())
    assert "| snapkv | 1/2, kv 0.100, 1.00s (0.50x) |" in table
    assert "| policy | 0.9 |" in table


def test_a_full_only_table_names_its_column_uncompressed():
    report = fake_report()
    report["results"] = [row for row in report["results"] if row["policy"] == "full"]
    table = markdown_table(report)
    assert "| policy | uncompressed |" in table and "| full | 2/2, kv 1.000, 2.00s (1.00x) |" in table


def test_report_files_are_written(tmp_path):
    write_niah_report(fake_report(), tmp_path)
    assert (tmp_path / "niah.md").exists()
    assert (tmp_path / "niah_heatmap_snapkv.png").stat().st_size > 0
    assert (tmp_path / "niah_accuracy_vs_bytes.png").stat().st_size > 0


def test_each_length_gets_its_own_tables(tmp_path):
    from kvwise.bench.niah_report import per_length

    def row(length, correct):
        return {
            "policy": "full", "ratio": 0.0, "length": length, "depth": 0.5, "trial": 0, "correct": correct,
            "kv_bytes": 2, "full_kv_bytes": 2, "full16_kv_bytes": 1, "seconds": 1.0, "budget": None,
        }  # fmt: skip

    report = {
        "config": {"mode": "agnostic", "lengths": [1000, 4000], "depths": [0.5], "trials_per_depth": 1, "seed": 0,
                   "model": None, "quant": None},
        "system": {"kvwise": "x", "torch": "x", "transformers": "x", "device": "cpu", "hardware": "x"},
        "results": [row(1000, True), row(4000, False)],
    }  # fmt: skip
    parts = per_length(report)
    assert [part["config"]["lengths"] for part in parts] == [[1000], [4000]]
    write_niah_report(report, tmp_path)
    text = (tmp_path / "niah.md").read_text()
    assert "lengths=[1000]" in text and "lengths=[4000]" in text
    assert "| full | 1/1," in text and "| full | 0/1," in text


def test_long_runs_one_resumable_grid_per_length(tmp_path, monkeypatch):
    from kvwise.bench import commands, niah
    from kvwise.cli import build_parser

    runs = []

    def fake_run(config, out, resume=True):
        runs.append((config, out))
        out.mkdir(parents=True)
        (out / "niah.md").write_text("table\n")
        return {"results": []}

    monkeypatch.setattr(niah, "run_niah", fake_run)
    for flags in ([], ["--quick"]):
        runs.clear()
        args = build_parser().parse_args(["bench", "niah", "--long", *flags, "--out", str(tmp_path / str(len(flags)))])
        commands._niah(args)
        assert [out.name for _, out in runs] == ["L4000", "L8000"]
        first, second = runs[0][0], runs[1][0]
        assert first.lengths == [4000] and first.budget_bytes == [0.05] and "kvzip:recent_window=64" in first.policies
        assert second.lengths == [8000] and second.policies == ["full"] and "kvzap+kivi4" in second.mixes
        assert ("kvzip:recent_window=64+int8" in first.mixes) == (not flags)
        assert ("kvzip:pass_chunk=128+kivi4" in second.mixes) == (not flags)
        assert (first.trials_per_depth, len(first.depths)) == ((1, 3) if flags else (2, 5))
        assert first.ratios == ([0.9] if flags else [0.9, 0.95])
