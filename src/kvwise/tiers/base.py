"""The one interface every tier implements: get / put / exists / delete by block key.

Keys are the chained block hashes of `core.hashing` (bytes), the same on every tier. Values are
tensors (a block's keys and values for every layer); each tier serialises them its own way.
Tiers count what happens to them in `TierStats`, which the server exports as metrics.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


class TierError(Exception):
    """A tier could not do what was asked (unreachable, full, refused); callers fall back."""


@dataclass
class TierStats:
    gets: int = 0
    hits: int = 0
    puts: int = 0
    refused_puts: int = 0  # writes a full or failing tier declined
    deletes: int = 0
    corrupt: int = 0  # entries that failed their checksum or authentication, deleted
    errors: int = 0  # backend failures (Redis down, I/O errors)
    bytes_held: int = 0


class Tier(ABC):
    name: str
    shared = False  # True: other servers read it too (Redis), so computed blocks are worth publishing

    def __init__(self):
        self.stats = TierStats()
        self.last_error: str | None = None  # the latest failure, for logs and tests

    @abstractmethod
    def get(self, key: bytes) -> torch.Tensor | None:
        """The block stored under `key`, or None (absent, corrupt, or the tier is down)."""

    @abstractmethod
    def put(self, key: bytes, block: torch.Tensor) -> bool:
        """Store a block; False when the tier declines (full, down). Never raises for those."""

    @abstractmethod
    def exists(self, key: bytes) -> bool: ...

    @abstractmethod
    def delete(self, key: bytes) -> None: ...
