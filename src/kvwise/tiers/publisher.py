"""`SharedPublisher`: newly computed prefix blocks, written to the shared tiers (Redis) off the
engine's step, in batches.

Blocks reach the other tiers when the device evicts them. A shared tier is read by other servers
too, so a block is worth writing there as soon as it is computed: another replica's request with
the same prefix then copies it instead of computing it. The engine thread only copies the block
(the device block may be evicted and zeroed before the write) and hands it over; a daemon thread
writes batches with one round trip each. When writes fall behind, new blocks are dropped, never
queued without bound: publishing is an optimisation, and a dropped block is recomputed elsewhere.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence

import torch

from kvwise.tiers.base import Tier

log = logging.getLogger("kvwise.tiers")

BATCH_BLOCKS = 32
DEFAULT_QUEUE_BYTES = 256 << 20
REMEMBERED_KEYS = 1 << 16  # published keys remembered, so an eviction does not write them again


class SharedPublisher:
    def __init__(self, tiers: Sequence[Tier], max_queue_bytes: int = DEFAULT_QUEUE_BYTES):
        self.tiers = list(tiers)
        self.max_queue_bytes = max_queue_bytes
        self.published = 0  # blocks a shared tier took
        self.dropped = 0  # blocks not published: the queue was full
        self.refused = 0  # blocks every shared tier refused (down, full)
        self._queue: deque[tuple[bytes, torch.Tensor]] = deque()
        self._queued_bytes = 0
        self._recent: OrderedDict[bytes, None] = OrderedDict()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvwise-publish", daemon=True)
        self._thread.start()

    def offer(self, key: bytes, block: torch.Tensor) -> bool:
        """Queue a copy of `block` ([layers, 2, block_size, kv_heads, head_dim]) under `key`;
        False when the queue is full (the block is dropped)."""
        with self._wake:
            if key in self._recent:
                return True
            if self._queued_bytes + block.nbytes > self.max_queue_bytes:
                self.dropped += 1
                return False
            self._queue.append((key, block))
            self._queued_bytes += block.nbytes
            self._remember(key)
            self._wake.notify()
        return True

    def published_recently(self, key: bytes) -> bool:
        with self._wake:
            return key in self._recent

    def recent_keys(self, count: int) -> list[bytes]:
        """The keys of the `count` blocks published most recently."""
        with self._wake:
            keys = list(self._recent)
        return keys[-count:]

    @property
    def pending(self) -> int:
        return len(self._queue)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the queue is written (tests, shutdown); False on timeout."""
        with self._wake:
            return self._wake.wait_for(lambda: not self._queue and not self._writing, timeout)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout=5)

    _writing = False

    def _remember(self, key: bytes) -> None:
        self._recent[key] = None
        if len(self._recent) > REMEMBERED_KEYS:
            self._recent.popitem(last=False)

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._queue or self._closed)
                if self._closed and not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(BATCH_BLOCKS, len(self._queue)))]
                self._queued_bytes -= sum(block.nbytes for _, block in batch)
                self._writing = True
            try:
                self._write(batch)
            finally:
                with self._wake:
                    self._writing = False
                    self._wake.notify_all()

    def _write(self, batch: list[tuple[bytes, torch.Tensor]]) -> None:
        taken = 0
        for tier in self.tiers:
            try:
                if hasattr(tier, "put_many"):
                    taken = max(taken, tier.put_many(batch))
                else:
                    taken = max(taken, sum(bool(tier.put(key, block)) for key, block in batch))
            except Exception as error:  # a tier bug must not end the publishing thread
                tier.stats.errors += 1
                tier.last_error = f"{type(error).__name__}: {error}"
                log.warning("publishing to the %s tier failed: %s", tier.name, error)
        self.published += taken
        self.refused += len(batch) - taken
        if taken < len(batch):  # not there: an eviction may write them later
            with self._wake:
                for key, _ in batch:
                    self._recent.pop(key, None)
