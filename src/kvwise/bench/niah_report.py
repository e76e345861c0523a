"""Markdown table and plots for `kvwise bench niah`."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import mean


def summarize(results: list[dict]) -> list[dict]:
    """One row per (policy, ratio): accuracy, bytes against full, seconds per trial."""
    cells = defaultdict(list)
    for row in results:
        cells[(row["policy"], row["ratio"])].append(row)
    summary = []
    for (policy, ratio), rows in cells.items():
        summary.append(
            {
                "policy": policy,
                "ratio": ratio,
                "correct": sum(row["correct"] for row in rows),
                "trials": len(rows),
                "kv_fraction": mean(row["kv_bytes"] / row["full_kv_bytes"] for row in rows),
                "kv16_fraction": mean(row["kv_bytes"] / row["full16_kv_bytes"] for row in rows),
                "kv_bytes": mean(row["kv_bytes"] for row in rows),
                "seconds": mean(row["seconds"] for row in rows),
            }
        )
    return summary


def markdown_table(report: dict) -> str:
    summary = summarize(report["results"])
    full_seconds = [row["seconds"] for row in summary if row["policy"] == "full"]
    baseline = full_seconds[0] if full_seconds else None
    ratios = sorted({row["ratio"] for row in summary if row["policy"] != "full"})
    policies = list(dict.fromkeys(row["policy"] for row in summary))
    by_cell = {(row["policy"], row["ratio"]): row for row in summary}
    config, system = report["config"], report["system"]
    lines = [
        f"NIAH, mode={config['mode']}, lengths={config['lengths']}, depths={config['depths']}, "
        f"trials/depth={config['trials_per_depth']}, seed={config['seed']}, "
        f"model={config['model'] or 'SmolLM2-135M-Instruct'}, prompt={report.get('prompt_format', 'chat template')}"
        + (f", quant={config['quant']} (kv16 = bytes held / a 16-bit full cache's)" if config.get("quant") else ""),
        f"system: kvwise {system['kvwise']}, torch {system['torch']}, transformers {system['transformers']}, "
        f"{system['device']} ({system['hardware']})",
        "",
        "Accuracy (correct/trials) per compression ratio; kv = bytes held / full cache bytes; "
        "s = seconds per trial (x = against `full` in this run).",
        "",
        "| policy | " + " | ".join(f"{ratio}" for ratio in ratios) + " |",
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
            cells.append(f"{row['correct']}/{row['trials']}, kv {row['kv_fraction']:.3f}{kv16}{speed}")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_niah_report(report: dict, out_dir: Path) -> None:
    (out_dir / "niah.md").write_text(markdown_table(report))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib); skipping the NIAH plots")
        return
    results = report["results"]
    for policy in dict.fromkeys(row["policy"] for row in results):
        rows = [row for row in results if row["policy"] == policy]
        ratios = sorted({row["ratio"] for row in rows})
        lengths = sorted({row["length"] for row in rows})
        depths = sorted({row["depth"] for row in rows})
        figure, axes = plt.subplots(1, len(ratios), figsize=(2.6 * len(ratios) + 1, 3), squeeze=False)
        for axis, ratio in zip(axes[0], ratios):
            grid = [
                [
                    mean(
                        r["correct"]
                        for r in rows
                        if r["ratio"] == ratio and r["length"] == length and r["depth"] == depth
                    )
                    for length in lengths
                ]
                for depth in depths
            ]
            image = axis.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            axis.set_title(f"ratio {ratio}")
            axis.set_xticks(range(len(lengths)), [str(length) for length in lengths])
            axis.set_yticks(range(len(depths)), [str(depth) for depth in depths])
            axis.set_xlabel("context length")
        axes[0][0].set_ylabel("needle depth")
        figure.colorbar(image, ax=axes[0].tolist())
        figure.suptitle(f"NIAH accuracy: {policy}")
        figure.savefig(out_dir / f"niah_heatmap_{policy}.png", dpi=100)
        plt.close(figure)
    figure, axis = plt.subplots(figsize=(7, 4.5))
    colors = plt.get_cmap("tab20").colors
    markers = "os^vD<>ph*"
    for index, policy in enumerate(dict.fromkeys(row["policy"] for row in results)):
        points = sorted(
            (row["kv_bytes"] / 1e6, row["correct"] / row["trials"])
            for row in summarize(results)
            if row["policy"] == policy
        )
        style = {"color": colors[index % len(colors)], "marker": markers[index % len(markers)]}
        axis.plot([p[0] for p in points], [p[1] for p in points], label=policy, **style)
    axis.set_xscale("log")
    axis.set_xlabel("KV bytes held after compression (MB, log)")
    axis.set_ylabel("accuracy")
    axis.set_title("NIAH accuracy against KV memory")
    axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(out_dir / "niah_accuracy_vs_bytes.png", dpi=100)
    plt.close(figure)
