"""`KVStats`: a snapshot of the engine's KV memory, what `KVCacheManager.stats()` returns to the
server's gauges and the benches."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TierUsage:
    """One prefix tier below the device: bytes held, capacity (None: unbounded), failures."""

    name: str
    bytes_held: int
    capacity_bytes: int | None
    hits_tokens: int
    corrupt: int
    errors: int
    available: bool = True  # answering now (a tier that failed rests a while; see RedisTier)
    published_blocks: int = 0  # computed blocks written to it at once (shared tiers with publishing on)


@dataclass(frozen=True)
class KVStats:
    """A snapshot of the engine's KV memory, in blocks and bytes that tensors really hold."""

    block_bytes: int  # one device block, every layer, keys and values
    num_blocks: int
    free_blocks: int
    used_blocks: int
    peak_used_blocks: int  # most device blocks in use after a forward
    prefix_cached_blocks: int  # device blocks the prefix tree holds
    prefix_evictions: int  # blocks evicted from the prefix tree
    prefix_spilled_blocks: int  # of those, blocks at least one tier accepted
    quantized_bytes: int  # every quantized pool
    quantization_errors: dict[str, tuple[float, float]]  # quantizer -> mean relative error (keys, values)
    swap_used_bytes: int | None  # None: no host swap space
    swap_capacity_bytes: int | None
    swapped_out_blocks: int
    swapped_in_blocks: int
    recomputed_blocks: int  # device blocks dropped by recompute preemptions
    head_page_bytes: int = 0  # head pages in use (evicted requests' regions), keys and values
    head_page_blocks: int = 0  # device blocks cut into head pages (counted in used_blocks)
    compressed_documents: int = 0  # documents compressed once, held for reuse on the device
    compressed_hits: int = 0  # requests that reused one instead of computing their document
    compressed_spilled: int = 0  # of those that left the device, written to a tier
    tiers: tuple[TierUsage, ...] = field(default_factory=tuple)

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.block_bytes

    @property
    def block_usage(self) -> float:
        """Share of the device pool's blocks in use, prefix-cached ones included."""
        return self.used_blocks / max(1, self.used_blocks + self.free_blocks)

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def peak_bytes(self) -> int:
        return self.peak_used_blocks * self.block_bytes

    @property
    def spill_ratio(self) -> float:
        """Of the device blocks given up (preemption, prefix-cache eviction), the share kept on a lower tier."""
        given_up = self.swapped_out_blocks + self.recomputed_blocks + self.prefix_evictions
        kept = self.swapped_out_blocks + self.prefix_spilled_blocks
        return kept / given_up if given_up else 0.0
