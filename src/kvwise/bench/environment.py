"""What every benchmark report records about the machine and the software."""

from __future__ import annotations

import platform

import torch

from kvwise._version import __version__
from kvwise.util.machine import cpu_model_and_flags, machine_line


def system_info(device: torch.device) -> dict:
    import transformers

    model, flags = cpu_model_and_flags()
    return {
        "cpu": model,
        "cpu_flags": flags,
        "kvwise": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "hardware": machine_line(device),
        "python": platform.python_version(),
    }
