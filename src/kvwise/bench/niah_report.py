"""Markdown table and plots for `kvwise bench niah`."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import mean, median

from kvwise.bench.report_files import model_label, system_line
from kvwise.util.pareto import pareto_front
from kvwise.util.plotting import headless_pyplot


def summarize(results: list[dict]) -> list[dict]:
    """One row per (policy, ratio): accuracy, bytes against full, seconds per trial."""
    cells = defaultdict(list)
    for row in results:
        if row.get("budget") is None:  # equal-bytes rows: `summarize_budgets`
            cells[(row["policy"], row["ratio"])].append(row)
    summary = []
    for (policy, ratio), rows in cells.items():
        summary.append({"policy": policy, "ratio": ratio, **_cell(rows)})
    return summary


def by_path(report: dict) -> dict:
    """The report with each row's policy named after its path (`engine:kvzip+kivi4`) when the
    run went through more than one path, so the tables and plots keep them apart."""
    paths = {row.get("path", "engine" if row.get("engine") else "library") for row in report["results"]}
    if len(paths) < 2:
        return report
    results = [{**row, "policy": f"{row['path']}:{row['policy']}"} for row in report["results"]]
    skipped = [{**row, "mix": f"{row['path']}:{row['mix']}"} for row in report.get("skipped", [])]
    return {**report, "results": results, "skipped": skipped}


def _is_full(policy: str) -> bool:
    return policy == "full" or policy.endswith(":full")


def markdown_table(report: dict) -> str:
    summary = summarize(report["results"])
    full_seconds = [row["seconds"] for row in summary if _is_full(row["policy"])]
    baseline = full_seconds[0] if full_seconds else None
    ratios = sorted({row["ratio"] for row in summary if not _is_full(row["policy"])})
    headers = [f"{ratio}" for ratio in ratios] or ["uncompressed"]
    ratios = ratios or [0.0]  # full alone: one column, which no ratio names
    policies = list(dict.fromkeys(row["policy"] for row in summary))
    by_cell = {(row["policy"], row["ratio"]): row for row in summary}
    config, system = report["config"], report["system"]
    lines = [
        f"NIAH, mode={config['mode']}, lengths={config['lengths']}, depths={config['depths']}, "
        f"trials/depth={config['trials_per_depth']}, seed={config['seed']}, "
        f"model={model_label(config)}, prompt={report.get('prompt_format', 'chat template')}"
        + (f", quant={config['quant']} (kv16 = bytes held / a 16-bit full cache's)" if config.get("quant") else ""),
        system_line(system, "torch", "transformers")
        + (f", paths: {', '.join(config['paths'])}" if config.get("paths") else ""),
        "",
        "Accuracy (correct/trials) per compression ratio; kv = bytes held / full cache bytes; "
        "s = median seconds per trial, cells interleaved trial by trial (x = against `full` in this run); "
        "peak = the most memory a trial needed above what the process held before it.",
        "",
        "| policy | " + " | ".join(headers) + " |",
        "|---|" + "---|" * len(ratios),
    ]
    for policy in policies:
        cells = []
        for ratio in ratios:
            row = by_cell.get((policy, ratio)) or by_cell.get((policy, 0.0))
            if row is None:
                cells.append("")
                continue
            speed = f", {row['seconds']:.2f}s" + (f" ({row['seconds'] / baseline:.2f}x)" if baseline else "")
            kv16 = f", kv16 {row['kv16_fraction']:.4f}" if config.get("quant") else ""
            cells.append(f"{row['correct']}/{row['trials']}, kv {row['kv_fraction']:.3f}{kv16}{speed}{_peak(row)}")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    refused = [row for row in report.get("skipped", []) if row.get("budget") is None]
    lines += [f"\n{row['mix']} at {row['ratio']}: not run ({row['why']})" for row in refused]
    return "\n".join(lines) + "\n"


def summarize_budgets(results: list[dict]) -> list[dict]:
    """One row per (mix, byte budget): accuracy, bytes held against a 16-bit full cache (mean and
    most), the ratio the budget set, seconds per trial."""
    cells = defaultdict(list)
    for row in results:
        if row.get("budget") is not None:
            cells[(row["policy"], row["budget"])].append(row)
    return [
        {
            "mix": mix,
            "budget": budget,
            **_cell(rows),
            "kv16_most": max(row["kv_bytes"] / row["full16_kv_bytes"] for row in rows),
            "ratio": mean(row["ratio"] for row in rows),
        }
        for (mix, budget), rows in cells.items()
    ]


def _cell(rows: list[dict]) -> dict:
    """Accuracy, bytes held (against the full cache, and a 16-bit one) and median seconds of one cell's trials."""
    return {
        "correct": sum(row["correct"] for row in rows),
        "trials": len(rows),
        "kv_fraction": mean(row["kv_bytes"] / row["full_kv_bytes"] for row in rows),
        "kv16_fraction": mean(row["kv_bytes"] / row["full16_kv_bytes"] for row in rows),
        "kv_bytes": mean(row["kv_bytes"] for row in rows),
        "seconds": median(row["seconds"] for row in rows),
        "peak_bytes": max((row.get("peak_bytes") or 0 for row in rows), default=0) or None,
    }


def _peak(row: dict) -> str:
    """ ", peak 1.23 GB": the most a trial of the cell needed above what the process held before it."""
    return f", peak {row['peak_bytes'] / 2**30:.2f} GB" if row.get("peak_bytes") else ""


def best_per_budget(summary: list[dict]) -> dict[float, dict]:
    """The most accurate mix of each budget (ties: the fewer bytes)."""
    best = {}
    for row in summary:
        current = best.get(row["budget"])
        if current is None or (row["correct"] / row["trials"], -row["kv16_fraction"]) > (
            current["correct"] / current["trials"],
            -current["kv16_fraction"],
        ):
            best[row["budget"]] = row
    return best


def budget_table(report: dict) -> str:
    """Accuracy at equal bytes: mixes by budget, the best of each budget in bold, the front, what was skipped."""
    summary = summarize_budgets(report["results"])
    skipped_rows = [row for row in report.get("skipped", []) if row.get("budget") is not None]
    if not summary and not skipped_rows:
        return ""
    budgets = sorted({row["budget"] for row in summary} | {row["budget"] for row in skipped_rows})
    budgets.reverse()
    mixes = list(dict.fromkeys([*(row["mix"] for row in summary), *(row["mix"] for row in skipped_rows)]))
    by_cell = {(row["mix"], row["budget"]): row for row in summary}
    skipped = {(row["mix"], row["budget"]): row["why"] for row in skipped_rows}
    best = best_per_budget(summary)
    lines = [
        "",
        "Equal bytes: accuracy per byte budget (bytes the context's KV holds after compression, everything "
        "counted, / a 16-bit full cache of the same context); kv16 = the mean held (most in brackets); "
        "r = the ratio the budget set; best mix per budget in bold.",
        "",
        "| mix | " + " | ".join(f"{budget}" for budget in budgets) + " |",
        "|---|" + "---|" * len(budgets),
    ]
    for mix in mixes:
        cells = []
        for budget in budgets:
            row = by_cell.get((mix, budget))
            if row is None:
                cells.append(f"skipped: {skipped[(mix, budget)]}" if (mix, budget) in skipped else "")
                continue
            text = (
                f"{row['correct']}/{row['trials']}, kv16 {row['kv16_fraction']:.4f} ({row['kv16_most']:.4f}), "
                f"r {row['ratio']:.3f}, {row['seconds']:.2f}s{_peak(row)}"
            )
            cells.append(f"**{text}**" if best.get(budget) is row else text)
        lines.append(f"| {mix} | " + " | ".join(cells) + " |")
    front = pareto_front(summary, lambda row: row["kv16_fraction"], lambda row: row["correct"] / row["trials"])
    lines += [
        "",
        "Pareto front (accuracy against bytes): "
        + ", ".join(f"{row['mix']} at {row['kv16_fraction']:.4f} -> {row['correct']}/{row['trials']}" for row in front),
    ]
    return "\n".join(lines) + "\n"


def per_length(report: dict) -> list[dict]:
    """The report cut by context length: a cell's trials are of one length (a 4000-token trial
    and a 1000-token one say different things)."""
    lengths = sorted({row["length"] for row in report["results"]})
    if len(lengths) <= 1:
        return [report]
    return [
        {
            **report,
            "config": {**report["config"], "lengths": [length]},
            "results": [row for row in report["results"] if row["length"] == length],
            "skipped": [row for row in report.get("skipped", []) if row.get("length", length) == length],
        }
        for length in lengths
    ]


def write_niah_report(report: dict, out_dir: Path) -> None:
    report = by_path(report)
    compare = f"\nkvpress rows missing: {report['compare_error']}\n" if report.get("compare_error") else ""
    tables = [markdown_table(part) + budget_table(part) for part in per_length(report)]
    (out_dir / "niah.md").write_text("\n".join(tables) + compare)
    plot_niah(report, out_dir)
    plot_budgets(report, out_dir)


def plot_budgets(report: dict, out_dir: Path) -> None:
    """Accuracy against bytes held, one line per mix, the Pareto front dashed."""
    summary = summarize_budgets(report["results"])
    plt = headless_pyplot("NIAH plots") if summary else None
    if plt is None:
        return
    figure, axis = plt.subplots(figsize=(7.5, 4.8), layout="constrained")
    for mix in dict.fromkeys(row["mix"] for row in summary):
        points = sorted((row["kv16_fraction"], row["correct"] / row["trials"]) for row in summary if row["mix"] == mix)
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=mix)
    front = pareto_front(summary, lambda row: row["kv16_fraction"], lambda row: row["correct"] / row["trials"])
    axis.plot(
        [row["kv16_fraction"] for row in front],
        [row["correct"] / row["trials"] for row in front],
        "k--",
        linewidth=1,
        label="Pareto front",
    )
    _save_accuracy_plot(
        plt,
        figure,
        axis,
        "KV bytes held / a 16-bit full cache's (log)",
        "NIAH accuracy at equal bytes",
        out_dir / "niah_equal_bytes.png",
    )


def plot_niah(report: dict, out_dir: Path) -> None:
    """Per policy, accuracy by needle depth: a heatmap against context length, or, when one length
    was run, bars per ratio (a one-column heatmap says little); then accuracy against KV bytes."""
    plt = headless_pyplot("NIAH plots")
    if plt is None:
        return
    results = [row for row in report["results"] if row.get("budget") is None]
    for policy in dict.fromkeys(row["policy"] for row in results):
        rows = [row for row in results if row["policy"] == policy]
        ratios = sorted({row["ratio"] for row in rows})
        lengths = sorted({row["length"] for row in rows})
        depths = sorted({row["depth"] for row in rows})

        def accuracy(ratio, length, depth, rows=rows):
            found = [r["correct"] for r in rows if (r["ratio"], r["length"], r["depth"]) == (ratio, length, depth)]
            return mean(found) if found else float("nan")  # a cell an interrupted run did not reach

        if len(lengths) == 1:
            figure, axis = plt.subplots(figsize=(7, 3.6), layout="constrained")
            width = 0.8 / len(ratios)
            for index, ratio in enumerate(ratios):
                xs = [d + (index - (len(ratios) - 1) / 2) * width for d in range(len(depths))]
                axis.bar(xs, [accuracy(ratio, lengths[0], depth) for depth in depths], width, label=f"ratio {ratio}")
            axis.set_xticks(range(len(depths)), [str(depth) for depth in depths])
            axis.set_xlabel("needle depth")
            axis.set_ylabel("accuracy")
            axis.set_ylim(0, 1.05)
            axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
            axis.set_title(f"NIAH accuracy: {policy}, {lengths[0]} tokens")
        else:
            figure, axes = plt.subplots(
                1, len(ratios), figsize=(2.8 * len(ratios) + 1.5, 3.4), squeeze=False, layout="constrained"
            )
            for axis, ratio in zip(axes[0], ratios):
                grid = [[accuracy(ratio, length, depth) for length in lengths] for depth in depths]
                image = axis.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
                axis.set_title(f"ratio {ratio}", fontsize=9)
                axis.set_xticks(range(len(lengths)), [str(length) for length in lengths])
                axis.set_yticks(range(len(depths)), [str(depth) for depth in depths])
                axis.set_xlabel("context length")
            axes[0][0].set_ylabel("needle depth")
            figure.colorbar(image, ax=axes[0].tolist())
            figure.suptitle(f"NIAH accuracy: {policy}")
        figure.savefig(out_dir / f"niah_heatmap_{policy}.png", dpi=100)
        plt.close(figure)
    figure, axis = plt.subplots(figsize=(7.5, 4.8), layout="constrained")
    colors = plt.get_cmap("tab10").colors
    markers = "osD^v<>ph*"
    for index, policy in enumerate(dict.fromkeys(row["policy"] for row in results)):
        points = sorted(
            (row["kv_bytes"] / 1e6, row["correct"] / row["trials"])
            for row in summarize(results)
            if row["policy"] == policy
        )
        # colour and marker cycle at different lengths: no two of the first 50 policies look alike
        style = {"color": colors[index % len(colors)], "marker": markers[(index // len(colors) + index) % len(markers)]}
        axis.plot([p[0] for p in points], [p[1] for p in points], label=policy, markersize=6, **style)
    _save_accuracy_plot(
        plt,
        figure,
        axis,
        "KV bytes held after compression (MB, log)",
        "NIAH accuracy against KV memory",
        out_dir / "niah_accuracy_vs_bytes.png",
    )


def _save_accuracy_plot(plt, figure, axis, x_label: str, title: str, path: Path) -> None:
    """Accuracy against bytes on a log scale, labelled, saved and closed."""
    axis.set_xscale("log")
    axis.set_xlabel(x_label)
    axis.set_ylabel("accuracy")
    axis.set_title(title)
    axis.legend(fontsize=7, ncol=2)
    figure.savefig(path, dpi=100)
    plt.close(figure)
