"""Read-only views of KV memory that the `KVCacheManager` hands out: what the model runner reads
and writes through, and where the prefix blocks are for a router."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvwise.engine.quant_pool import QuantPool
from kvwise.kv.paged import PagedKVStorage


@dataclass(frozen=True)
class RoutingSnapshot:
    """Where an engine's prefix blocks are (block keys), and what restoring one costs per tier."""

    device: list[bytes]
    host: list[bytes]
    published: list[bytes]
    restore_seconds_per_block: dict[str, float]


@dataclass(frozen=True)
class RunnerView:
    """The model runner's read-only view of KV memory: where blocks are read and written."""

    storage: PagedKVStorage
    quant_pools: Mapping[str, QuantPool]
