"""Markdown table and plot for `kvwise bench ppl`."""

from __future__ import annotations

from pathlib import Path


def describe(row: dict) -> str:
    """A short label for a system's configuration."""
    config = row["config"]
    if row["system"] != "kvwise":
        axis = {None: "default", 0: "default", -1: "keys per channel"}.get(
            config.get("axis_key"), str(config.get("axis_key"))
        )
        return f"int{config['nbits']}, {axis}"
    parts = []
    if config["policy"] != "full":
        parts.append(f"{config['policy']} @ {config['max_kv_tokens']} tokens")
    if config["quant"]:
        parts.append(config["quant"])
    return " + ".join(parts) or "full cache"


def markdown_table(report: dict) -> str:
    config, system = report["config"], report["system"]
    lines = [
        f"PPL, tokens={config['tokens']} in chunks of {config['chunk']}, "
        f"model={config['model'] or 'SmolLM2-135M-Instruct'} ({report['model_dtype']}), "
        f"fastest of {config.get('repeats', 1)} passes per system",
        f"system: kvwise {system['kvwise']}, torch {system['torch']}, transformers {system['transformers']}, "
        f"{system['device']} ({system['hardware']})",
        "",
        "ppl_ratio and speed are against the full cache in this run; kv16 = KV bytes held at the end / "
        "what a 16-bit full cache holds for the same tokens.",
        "",
        "| system | config | ppl | ppl_ratio | kv16 | tokens/s | speed vs full |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        lines.append(
            f"| {row['system']} | {describe(row)} | {row['ppl']:.3f} | {row['ppl_ratio']:.4f} | "
            f"{row['kv_bytes'] / row['full16_kv_bytes']:.4f} | {row['tokens_per_second']:.0f} | "
            f"{row['speed_vs_full']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def write_ppl_report(report: dict, out_dir: Path) -> None:
    (out_dir / "ppl.md").write_text(markdown_table(report))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib); skipping the ppl plot")
        return
    figure, axes = plt.subplots(figsize=(9, 6))
    markers = {"kvwise": "o", "hf-quanto": "s", "hf-hqq": "^"}
    colors = plt.get_cmap("tab20")
    for index, row in enumerate(report["results"]):
        axes.scatter(
            row["kv_bytes"] / row["full16_kv_bytes"],
            row["ppl_ratio"],
            marker=markers.get(row["system"], "x"),
            color=colors(index % 20),
            label=f"{row['system']}: {describe(row)}",
        )
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("KV bytes / 16-bit full cache (log)")
    axes.set_ylabel("perplexity / full cache perplexity (log)")
    axes.set_title(f"Perplexity against KV memory, {report['config']['tokens']} essay tokens")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=6, loc="upper right", ncol=2)
    figure.tight_layout()
    figure.savefig(out_dir / "ppl.png", dpi=110)
    plt.close(figure)
