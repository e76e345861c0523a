"""What every benchmark report records about the machine and the software."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from kvwise._version import __version__


def system_info(device: torch.device) -> dict:
    import transformers

    model, flags = cpu_model_and_flags()
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        cores = f"x{os.cpu_count()} cores, {torch.get_num_threads()} threads"
        hardware = f"{model or platform.processor() or platform.machine()} {cores}"
        if flags:
            hardware += f"; {' '.join(flags)}"
    return {
        "cpu": model,
        "cpu_flags": flags,
        "kvwise": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "hardware": hardware,
        "python": platform.python_version(),
    }


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
