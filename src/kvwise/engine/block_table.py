"""`BlockTable`: a request's KV blocks in order, and where each one lives.

Entry i holds the request's KV slots [i * block_size, (i + 1) * block_size). `block_ids[i]` is
an id in the pool of `places[i]`:

    Place.DEVICE     a block of the device pool (`PagedKVStorage`, ids from the `BlockPool`)
    Place.QUANTIZED  a block of the request's quantized pool (`QuantPool`, its own ids)
    Place.HOST       a block of the request's host copy while it is swapped out (`SwappedKV`, by index)

Only the `KVCacheManager` changes a table; the runner reads it. Plain lists inside, because the
runner reads ids for every token of a step.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import torch


class Place(enum.Enum):
    DEVICE = "device"
    QUANTIZED = "quantized"
    HOST = "host"


class BlockTable:
    __slots__ = ("block_ids", "places")

    def __init__(self, block_ids: Iterable[int] = (), place: Place = Place.DEVICE):
        self.block_ids: list[int] = list(block_ids)
        self.places: list[Place] = [place] * len(self.block_ids)

    def __len__(self) -> int:
        return len(self.block_ids)

    def __repr__(self) -> str:
        return f"BlockTable({list(zip(self.block_ids, (place.value for place in self.places)))})"

    def append(self, block_ids: Iterable[int], place: Place = Place.DEVICE) -> None:
        block_ids = list(block_ids)
        self.block_ids += block_ids
        self.places += [place] * len(block_ids)

    def indices(self, place: Place) -> list[int]:
        """Table positions of the entries in `place`."""
        return [index for index, where in enumerate(self.places) if where is place]

    def ids(self, place: Place) -> list[int]:
        """Ids of the entries in `place`, in table order."""
        return [block for block, where in zip(self.block_ids, self.places) if where is place]

    def count(self, place: Place) -> int:
        return self.places.count(place)

    def all_in(self, place: Place) -> bool:
        return self.places.count(place) == len(self.places)

    def move(self, index: int, place: Place, block_id: int) -> None:
        """Entry `index` now lives in `place` as `block_id`."""
        self.places[index], self.block_ids[index] = place, block_id

    def slots(self, indices: torch.Tensor, block_size: int) -> torch.Tensor:
        """[n] int64 pool slots of the KV indices `indices` [n] (entries on the device)."""
        blocks = torch.tensor(self.block_ids, dtype=torch.long, device=indices.device)
        return blocks[indices // block_size] * block_size + indices % block_size

    def cut(self, length: int) -> BlockTable:
        """Remove the entries from `length` on and return them."""
        tail = BlockTable()
        tail.block_ids, tail.places = self.block_ids[length:], self.places[length:]
        del self.block_ids[length:], self.places[length:]
        return tail
