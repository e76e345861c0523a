"""Markdown table and plot for `kvwise bench ppl`."""

from __future__ import annotations

from pathlib import Path

from kvwise.bench.report_files import model_label, system_line
from kvwise.kv.quantizer import make_quantizer
from kvwise.util.plotting import headless_pyplot


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
        parts.append(short_quant(config["quant"]))
    return " + ".join(parts) or "full cache"


def short_quant(spec: str) -> str:
    """A quantizer's name where its spec holds only the defaults (a mix's quantizer arrives in its
    canonical spelling, every option written out), else the whole spec."""
    name = spec.split(":", 1)[0]
    try:
        return name if make_quantizer(name).spec == spec else spec
    except ValueError:
        return spec


def system_label(row: dict) -> str:
    """The system, and the path for kvwise's engine rows."""
    return f"{row['system']} (engine)" if row.get("path") == "engine" else row["system"]


def markdown_table(report: dict) -> str:
    config, system = report["config"], report["system"]
    lines = [
        f"PPL, tokens={config['tokens']} in chunks of {config['chunk']}, "
        f"model={model_label(config)} ({report['model_dtype']}), "
        f"fastest of {config.get('repeats', 1)} passes per system",
        system_line(system, "torch", "transformers"),
        "",
        "ppl_ratio and speed are against the full cache in this run; kv16 = KV bytes held at the end / "
        "what a 16-bit full cache holds for the same tokens.",
        "",
        "| system | config | ppl | ppl_ratio | kv16 | tokens/s | speed vs full |",
        "|---|---|---|---|---|---|---|",
    ]
    paths = config.get("paths", ["library"])
    if paths != ["library"]:
        lines[3] += (
            " Engine rows (path engine) are scored through the serving engine: after the first chunk, one "
            "token a step through its decode path, in one pass; their ratios are against the engine's full cache."
        )
    for row in report["results"]:
        lines.append(
            f"| {system_label(row)} | {describe(row)} | {row['ppl']:.3f} | {row['ppl_ratio']:.4f} | "
            f"{row['kv_bytes'] / row['full16_kv_bytes']:.4f} | {row['tokens_per_second']:.0f} | "
            f"{row['speed_vs_full']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


PPL_AXIS_CAP = 1.3  # perplexity ratios above this sit on the top edge, annotated with their value


def family(row: dict) -> str:
    """The group a system belongs to in the plot: one colour and marker each."""
    if row["system"] != "kvwise":
        return f"transformers QuantizedCache ({row['system'].removeprefix('hf-')})"
    config = row["config"]
    if row.get("path") == "engine":
        return "kvwise engine (decode path)"
    evicts, quantizes = config["policy"] != "full", bool(config["quant"])
    if evicts and quantizes:
        return "kvwise: decode budget + quantizer"
    if evicts:
        return "kvwise: decode budget"
    return "kvwise: quantizer" if quantizes else "kvwise: full cache"


def plot_ppl(report: dict, path: Path) -> None:
    """Perplexity ratio against KV bytes, one colour per family, the ratio axis capped so the points
    that matter (near 1) stay apart; points beyond the cap are drawn on the edge with their value."""
    plt = headless_pyplot("ppl plot")
    if plt is None:
        return
    families = list(dict.fromkeys(family(row) for row in report["results"]))
    styles = dict(zip(families, zip(plt.get_cmap("tab10").colors, "os^Dvp<>")))
    figure, axes = plt.subplots(figsize=(10, 6), layout="constrained")
    for name in families:
        rows = [row for row in report["results"] if family(row) == name]
        color, marker = styles[name]
        x = [row["kv_bytes"] / row["full16_kv_bytes"] for row in rows]
        y = [min(row["ppl_ratio"], PPL_AXIS_CAP) for row in rows]
        axes.scatter(x, y, color=color, marker=marker, s=36, label=name)
        for xi, yi, row in zip(x, y, rows):
            label = (
                describe(row)
                if row["ppl_ratio"] <= PPL_AXIS_CAP
                else f"{describe(row)}: {row['ppl_ratio']:.2f} (off scale)"
            )
            axes.annotate(label, (xi, yi), fontsize=6, xytext=(4, 2), textcoords="offset points", color=color)
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_xscale("log")
    axes.set_ylim(top=PPL_AXIS_CAP + 0.01)
    axes.set_xlabel("KV bytes / 16-bit full cache (log)")
    axes.set_ylabel(f"perplexity / full cache perplexity (capped at {PPL_AXIS_CAP})")
    axes.set_title(f"Perplexity against KV memory, {report['config']['tokens']} essay tokens")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7, loc="upper right")
    figure.savefig(path, dpi=110)
    plt.close(figure)
