"""Where each prefix block is, per replica and tier, and the routing score that follows from it.

Pure bookkeeping (no Ray): the router feeds it what replicas report and what it routed itself,
and asks for a ranking. Blocks are named by `short_key`, the first 8 bytes of kvwise's chained
block key. Those keys are keyed hashes over the server's namespace secret and the tenant, so the
directory holds no prompt text and nothing another tenant could match against its own prompts.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

DEVICE, HOST, SHARED = "device", "host", "shared"
# a block restored from a tier saves its prefill, less the copy; these are the defaults until the
# replicas report measured restore costs (seconds per block restored / seconds per block computed)
DEFAULT_RESTORE_COST = {DEVICE: 0.0, HOST: 0.1, SHARED: 0.3}
ROUTED_BLOCKS_SECONDS = 30.0  # how long blocks the router sent somewhere count before a report confirms them


def short_key(key: bytes) -> int:
    """The routing name of a block: its chained key's first 8 bytes, as an int."""
    return int.from_bytes(key[:8], "little")


@dataclass
class ReplicaReport:
    """What one replica says about itself (its `record_routing_stats`)."""

    device: frozenset[int] = frozenset()
    host: frozenset[int] = frozenset()
    queued_prefill_tokens: int = 0
    running: int = 0
    waiting: int = 0
    restore_cost: dict[str, float] = field(default_factory=dict)
    reported_at: float = 0.0  # the replica's wall clock when it made the report

    @classmethod
    def from_stats(cls, stats: dict | None) -> ReplicaReport:
        stats = stats or {}
        return cls(
            frozenset(stats.get("device", ())),
            frozenset(stats.get("host", ())),
            int(stats.get("queued_prefill_tokens", 0)),
            int(stats.get("running", 0)),
            int(stats.get("waiting", 0)),
            dict(stats.get("restore_cost", {})),
            float(stats.get("reported_at", 0.0)),
        )


@dataclass
class Choice:
    replica: str
    matched: dict[str, int]  # blocks of the request's prefix found, per tier
    cost: float  # estimated prefill tokens ahead of and including this request's uncached ones


class PrefixDirectory:
    """Args:
    block_size: tokens per block (the replicas').
    decode_weight: prefill tokens one running request's decode costs the queue, per routing.
    imbalance: the load guard: when the best match has this many more requests in flight than the
        least-loaded replica, the least-loaded one is chosen instead.
    """

    def __init__(self, block_size: int = 16, decode_weight: float = 64.0, imbalance: int = 8):
        self.block_size, self.decode_weight, self.imbalance = block_size, decode_weight, imbalance
        self.reports: dict[str, ReplicaReport] = {}
        self.shared: set[int] = set()  # blocks on the shared tier (Redis), which every replica reads
        self._routed: dict[str, dict[int, float]] = {}  # replica -> block -> when the router sent it there
        # replica -> request id -> (uncached prefill tokens still to compute, wall time it was sent,
        # whether the replica has started answering it)
        self._in_flight: dict[str, dict[str, tuple[int, float, bool]]] = {}
        # replica -> wall time of the router's latest news of a request there (answered, finished):
        # a report older than that no longer describes the replica's queue
        self._heard_from: dict[str, float] = {}

    # ---- what the replicas and the router learn -------------------------------------------------
    def report(self, replica: str, stats: dict | None) -> None:
        report = ReplicaReport.from_stats(stats)
        self.reports[replica] = report
        self.shared.update((stats or {}).get("published", ()))
        routed = self._routed.get(replica)
        if routed:  # blocks the replica now reports need no optimistic entry
            for block in report.device & routed.keys():
                del routed[block]

    def forget(self, replica: str) -> None:
        """A replica that died or left: nothing is routed to it for its blocks."""
        self.reports.pop(replica, None)
        self._routed.pop(replica, None)
        self._in_flight.pop(replica, None)
        self._heard_from.pop(replica, None)

    def routed(self, replica: str, request_id: str, blocks: Sequence[int], uncached_tokens: int) -> None:
        """The router sent a request there: its blocks will be on that device (before any report)."""
        now = time.monotonic()
        self._routed.setdefault(replica, {}).update(dict.fromkeys(blocks, now))
        self._in_flight.setdefault(replica, {})[request_id] = (uncached_tokens, time.time(), False)

    def answering(self, replica: str, request_id: str) -> None:
        """The replica started answering the request: its prefill is done, its decode goes on."""
        in_flight = self._in_flight.get(replica, {})
        if request_id in in_flight:
            in_flight[request_id] = (0, in_flight[request_id][1], True)
            self._heard_from[replica] = time.time()

    def completed(self, replica: str, request_id: str) -> None:
        """The request finished there (told by whoever hears first; a second telling is a no-op)."""
        if self._in_flight.get(replica, {}).pop(request_id, None) is not None:
            self._heard_from[replica] = time.time()

    # ---- the decision ---------------------------------------------------------------------------
    def match(self, replica: str, blocks: Sequence[int]) -> dict[str, int]:
        """Leading blocks of `blocks` the replica can use, by where they are: its device, its host
        tier, or the shared tier. A prefix ends at its first block found nowhere."""
        report = self.reports.get(replica, ReplicaReport())
        routed = self._fresh_routed(replica)
        found = {DEVICE: 0, HOST: 0, SHARED: 0}
        for block in blocks:
            if block in report.device or block in routed:
                found[DEVICE] += 1
            elif block in report.host:
                found[HOST] += 1
            elif block in self.shared:
                found[SHARED] += 1
            else:
                break
        return found

    def rank(self, replicas: Iterable[str], blocks: Sequence[int], prompt_tokens: int) -> list[Choice]:
        """Replicas best first. A replica's cost is the prefill it has queued plus this request's
        tokens it would compute (blocks restored from a tier count at their restore cost), plus
        its decode load; the load guard puts the least-loaded replica first when the best one has
        `imbalance` more requests in flight."""
        choices = []
        for replica in replicas:
            matched = self.match(replica, blocks)
            restore = {**DEFAULT_RESTORE_COST, **self.reports.get(replica, ReplicaReport()).restore_cost}
            saved = sum(count * (1.0 - min(1.0, restore[tier])) for tier, count in matched.items())
            uncached = max(0.0, prompt_tokens - saved * self.block_size)
            choices.append(Choice(replica, matched, self.queued_tokens(replica) + uncached + self._decode(replica)))
        # at equal cost (nothing cached anywhere), the replica holding the fewest blocks: new
        # prefixes spread, as SGLang's router sends a miss to the smallest tree
        choices.sort(key=lambda choice: (choice.cost, self.load(choice.replica), self.held(choice.replica)))
        if len(choices) > 1:
            least = min(choices, key=lambda choice: self.load(choice.replica))
            if self.load(choices[0].replica) - self.load(least.replica) >= self.imbalance:
                choices.remove(least)
                choices.insert(0, least)
        return choices

    def load(self, replica: str) -> int:
        """Requests in flight there: what the router sent and has not seen finish, or what the
        replica reported, whichever is more."""
        report = self._load_report(replica)
        return max(len(self._in_flight.get(replica, {})), report.running + report.waiting)

    def held(self, replica: str) -> int:
        """Blocks the replica's device holds, as far as the router knows."""
        report = self.reports.get(replica, ReplicaReport())
        return len(report.device) + len(self._fresh_routed(replica).keys() - report.device)

    def queued_tokens(self, replica: str) -> float:
        """Prefill tokens ahead of a new request there: what the replica last reported queued, plus
        what the router sent it since (a request already prefilled no longer counts, though it
        is still in flight)."""
        report = self._load_report(replica)
        sent_since = sum(
            tokens for tokens, sent, _ in self._in_flight.get(replica, {}).values() if sent >= report.reported_at
        )
        return float(report.queued_prefill_tokens + sent_since)

    def _decode(self, replica: str) -> float:
        decoding = sum(answered for _, _, answered in self._in_flight.get(replica, {}).values())
        return self.decode_weight * max(self._load_report(replica).running, decoding)

    def _load_report(self, replica: str) -> ReplicaReport:
        """The replica's last report as a measure of its load. One made before the router's latest
        news from the replica (a request there answered or finished since) still counts what is
        gone, so the router's own count of what it sent stands alone until the next report."""
        report = self.reports.get(replica, ReplicaReport())
        return ReplicaReport() if report.reported_at < self._heard_from.get(replica, 0.0) else report

    def _fresh_routed(self, replica: str) -> dict[int, float]:
        routed = self._routed.get(replica, {})
        cutoff = time.monotonic() - ROUTED_BLOCKS_SECONDS
        stale = [block for block, when in routed.items() if when < cutoff]
        for block in stale:
            del routed[block]
        return routed

    def known_blocks(self) -> int:
        """Every block name the directory holds (tests: it holds names, never text)."""
        names = set(self.shared)
        for replica, report in self.reports.items():
            names |= report.device | report.host | self._routed.get(replica, {}).keys()
        return len(names)
