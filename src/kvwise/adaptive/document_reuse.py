"""`DocumentReuse`: how often each document was asked about, and the form `auto` chose for it.

A request that marks its leading tokens as a document (`compress_upto`) is a sighting of that
document. Under a stable popularity, the times a document was asked about so far are the best
guess of how often it will be asked again, so the controller compresses a document once the
misses that copy would spare pay for compressing it (`worth_compressing`), and keeps the mix it
chose, so that later requests find the compressed copy (its key holds the mix).

Records are keyed by tenant and a digest of the tokens, so one tenant's documents never shape
another's choices, and the oldest records go first past `capacity`: a document not asked about
for that long is a new one again.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class DocumentRecord:
    sightings: int = 0
    mix: str | None = None  # the compressed form chosen for it, once chosen


class DocumentReuse:
    def __init__(self, capacity: int = 4096):
        if capacity < 1:
            raise ValueError(f"the document record capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._records: OrderedDict[bytes, DocumentRecord] = OrderedDict()  # least recently seen first

    def __len__(self) -> int:
        return len(self._records)

    def sight(self, tenant: str, tokens: Sequence[int]) -> DocumentRecord:
        """Count one more request for the document `tokens` of `tenant`; returns its record."""
        digest = hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16)
        digest.update(tenant.encode())
        key = digest.digest()
        record = self._records.pop(key, None) or DocumentRecord()
        record.sightings += 1
        self._records[key] = record
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)
        return record


def worth_compressing(sightings: int, prefill_seconds_per_token: float | None, extra_seconds_per_token: float) -> bool:
    """Whether a document asked about `sightings` times (this request included), held nowhere in
    full, is worth compressing now: the misses it would spare ahead, as many as it had after its
    first sighting, each a prefill, against the extra seconds compressing it costs. Without
    measured costs, any document asked about twice is."""
    if sightings < 2:
        return False
    if prefill_seconds_per_token is None:
        return True
    return (sightings - 1) * prefill_seconds_per_token > extra_seconds_per_token
