"""`CompressedPrefixes`: documents compressed once in the engine, reused by later requests.

A request that marks its leading tokens as a document to compress (`compress_upto`) compresses
them query-agnostically: the question after them is read only once the compaction is done. Its
region (what each layer and KV head kept, in pages) is then published here, and a later request
with the same tokens before its question, in the same namespace, with the same mix, takes that
region read-only and computes only its question.

    key     `core.hashing.compressed_key`: the tokens up to the document's end, the request's own
            namespace (model weights, tenant, KV dtype, the server's secret) and the mix spec
    entry   the tokens (a hit is confirmed by comparing them), the shared prefix the document
            was compressed after (`reused` tokens of prefix-cache blocks, found again on a hit),
            the region and its policy's running statistics

A region is held by the cache and by every request reading it (`HeadRegion.holders`); its pages
go back (zeroed) when the last holder lets go. Under memory pressure the least recently used
entries that no running request reads are dropped, after the prefix cache's unlocked blocks;
with prefix tiers they are written there first (`compressed_payload.py`) and a later request
brings them back, quantized codes bit for bit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvwise.engine.head_region import HeadRegion


@dataclass
class CompressedEntry:
    tokens: tuple[int, ...]
    reused: int  # tokens of shared prefix blocks before the document when it was compressed
    region: HeadRegion
    stats: list | None  # the policy's running statistics per layer, or None
    hits: int = 0


class CompressedPrefixes:
    def __init__(self):
        self.entries: OrderedDict[bytes, CompressedEntry] = OrderedDict()  # least recently used first
        self.hits = self.misses = self.evictions = 0
        self.spilled = self.restored = 0  # entries written to the tiers, and brought back from them

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: bytes, tokens: Sequence[int]) -> CompressedEntry | None:
        entry = self.entries.get(key)
        if entry is None or entry.tokens != tuple(tokens):
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        return entry

    def record_hit(self, entry: CompressedEntry) -> None:
        entry.hits += 1
        self.hits += 1

    def put(self, key: bytes, entry: CompressedEntry) -> CompressedEntry | None:
        """Publish `entry` (the cache holds its region from now on); returns the entry it
        replaced, whose region the caller lets go of."""
        entry.region.holders += 1
        replaced = self.entries.pop(key, None)
        self.entries[key] = entry
        return replaced

    def evict_one(self, store=None) -> tuple[bytes, CompressedEntry] | None:
        """Drop the least recently used entry no request reads (whose pages are in `store`, when
        given); the caller lets go of its region (after spilling it to the tiers, if any)."""
        for key, entry in self.entries.items():
            if entry.region.holders == 1 and (store is None or entry.region.quant is store):
                del self.entries[key]
                self.evictions += 1
                return key, entry
        return None
