"""`CacheConfig`: the engine's memory and batching settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 2048
    token_budget: int = (
        1024  # tokens computed per step (prefill chunks + decodes); 1024 was fastest on CPU of 512/1024/2048
    )
    max_running: int = 64
    prefix_caching: bool = True
    # host memory for preempted requests' KV (vLLM's swap space); 0: preemption recomputes
    swap_space_bytes: int = 4 << 30

    def __post_init__(self):
        for name in ("block_size", "num_blocks", "token_budget", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
