"""`DocumentReuse`: how often each document was asked about, and the form `auto` chose for it.

A request that marks its leading tokens as a document (`compress_upto`) is a sighting of that
document. How often it will be asked about again is guessed from two things: the times it was
asked about again so far, and, for a document with little history of its own, how often the
tenant's documents were asked about again on average (repeat sightings per distinct document):
a store where most documents come back is worth compressing into from a document's first
sighting, one where they rarely do is not. The controller compresses a document once the misses
that guess spares pay for compressing it (`worth_compressing`), and keeps the mix it chose, so
that later requests find the compressed copy (its key holds the mix).

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
    expected_reuse: float = 0.0  # times it is expected to be asked about again, as of its last sighting


class DocumentReuse:
    def __init__(self, capacity: int = 4096):
        if capacity < 1:
            raise ValueError(f"the document record capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._records: OrderedDict[bytes, DocumentRecord] = OrderedDict()  # least recently seen first
        self._totals: dict[str, list[int]] = {}  # tenant -> [distinct documents, sightings]

    def __len__(self) -> int:
        return len(self._records)

    def sight(self, tenant: str, tokens: Sequence[int]) -> DocumentRecord:
        """Count one more request for the document `tokens` of `tenant`; returns its record, with
        its expected reuse: the larger of its own repeats so far and the tenant's mean repeats per
        document before this sighting."""
        digest = hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16)
        digest.update(tenant.encode())
        key = digest.digest()
        totals = self._totals.setdefault(tenant, [0, 0])
        mean_repeats = (totals[1] - totals[0]) / totals[0] if totals[0] else 0.0
        record = self._records.pop(key, None)
        if record is None:
            record = DocumentRecord()
            totals[0] += 1
        record.sightings += 1
        totals[1] += 1
        record.expected_reuse = max(record.sightings - 1, mean_repeats)
        self._records[key] = record
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)
        return record


def worth_compressing(
    expected_reuse: float, prefill_seconds_per_token: float | None, extra_seconds_per_token: float
) -> bool:
    """Whether a document held nowhere in full, expected to be asked about `expected_reuse` more
    times, is worth compressing now: the misses that spares, each a prefill, against the extra
    seconds compressing it costs. Without measured costs, one expected back at least once is."""
    if expected_reuse <= 0:
        return False
    if prefill_seconds_per_token is None:
        return expected_reuse >= 1
    return expected_reuse * prefill_seconds_per_token > extra_seconds_per_token
