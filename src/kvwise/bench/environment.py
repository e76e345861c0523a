"""What every benchmark report records about the machine and the software."""

from __future__ import annotations

import os
import platform

import torch

from kvwise._version import __version__


def system_info(device: torch.device) -> dict:
    import transformers

    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = (
            f"{platform.processor() or platform.machine()} x{os.cpu_count()} cores, {torch.get_num_threads()} threads"
        )
    return {
        "kvwise": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "hardware": hardware,
        "python": platform.python_version(),
    }
