"""One writer for every bench's report: the JSON record, its Markdown table and its plots, with
the header lines (model, system) every table starts with."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from kvwise.bench.environment import system_info

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"


def new_report(workload: str, config, device: torch.device, **fields) -> dict:
    """A report's record: the workload, its config (a dataclass), the system it ran on, then `fields`."""
    return {"workload": workload, "config": asdict(config), "system": system_info(device), **fields}


def write_report(
    out_dir: Path,
    report: dict,
    markdown: Callable[[dict], str],
    plots: dict[str, Callable[[dict, Path], None]] | None = None,
) -> dict:
    """`<workload>.json`, `<workload>.md` and each plot (file name -> plotter) into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = report["workload"]
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out_dir / f"{name}.md").write_text(markdown(report))
    for file_name, plotter in (plots or {}).items():
        plotter(report, out_dir / file_name)
    return report


def model_label(config: dict) -> str:
    """The model a report ran: the one given, or the embedded one."""
    return config.get("model") or EMBEDDED_MODEL


def system_line(system: dict, *packages: str) -> str:
    """`system: kvwise 0.2.0, [torch ..., transformers ...,] cpu (x86_64 x2 cores, ...)`."""
    versions = [f"kvwise {system['kvwise']}", *(f"{package} {system[package]}" for package in packages)]
    return f"system: {', '.join(versions)}, {system['device']} ({system['hardware']})"
