"""The one interface every tier implements: get / put / exists / delete by block key.

Keys are the chained block hashes of `core.hashing` (bytes), the same on every tier. Values are
tensors (a block's keys and values for every layer); each tier serialises them its own way.
Tiers count what happens to them in `TierStats`, which the server exports as metrics.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
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
    lends = False  # True: `borrow` lends its own memory (host RAM), which callers must not zero

    def __init__(self):
        self.stats = TierStats()
        self.last_error: str | None = None  # the latest failure, for logs and tests

    @abstractmethod
    def get(self, key: bytes) -> torch.Tensor | None:
        """The block stored under `key`, or None (absent, corrupt, or the tier is down)."""

    @abstractmethod
    def put(self, key: bytes, block: torch.Tensor) -> bool:
        """Store a block; False when the tier declines (full, down). Never raises for those."""

    def get_many(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        """`get` for each key, in order; a tier with round trips to save batches them (Redis)."""
        return [self.get(key) for key in keys]

    @contextmanager
    def borrow(self, keys: Sequence[bytes]) -> Iterator[list[torch.Tensor | None]]:
        """The blocks under `keys` (None where absent), valid inside the `with`: a tier that holds
        blocks in memory lends them without a copy and keeps them from eviction meanwhile (host);
        the others hand over what `get_many` read."""
        yield self.get_many(keys)

    @abstractmethod
    def exists(self, key: bytes) -> bool: ...

    @abstractmethod
    def delete(self, key: bytes) -> None: ...
