"""What machine this is: the CPU's model and the flags that decide which kernels it can run."""

from __future__ import annotations

import os
import platform
from pathlib import Path

# the instruction sets that decide which kernels a CPU run can use (vector width, bfloat16, AMX)
_SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


def cpu_model_and_flags() -> tuple[str | None, list[str]]:
    """The CPU's model name and the speed-relevant flags it reports (Linux `/proc/cpuinfo`);
    (None, []) where that file is not there."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None, []
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {name.strip(): value.strip() for name, value in fields.items()}
    present = set(fields.get("flags", "").split())
    return fields.get("model name"), [flag for flag in _SPEED_FLAGS if flag in present]


def machine_line(device) -> str:
    """One line naming what a measurement ran on: the GPU, or the CPU with its cores and flags."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model, flags = cpu_model_and_flags()
    name = model or platform.processor() or platform.machine()
    line = f"{name} x{os.cpu_count()} cores, {torch.get_num_threads()} threads"
    return line + (f"; {' '.join(flags)}" if flags else "")
