"""Ray Serve request routers for kvwise's engine replicas (Ray Serve's `RequestRouter` API).

- `KVWiseRouter` ("kvwise"): routes by where the request's prefix blocks are. It scores each
  replica with `PrefixDirectory`: blocks on its device, in its host tier, on the shared tier
  (Redis), credited by their measured restore cost, against its queued prefill and decode load,
  with a load guard. Replicas report their blocks through Ray's routing stats; what the router
  sends somewhere counts there at once, before the next report.
- `PowerOfTwoRouter` ("pow2"): Ray's `PowerOfTwoChoicesRequestRouter`, unchanged for requests.
- `TextPrefixRouter` ("text-prefix"): a stand-in for Ray Serve LLM's `PrefixCacheAffinityRouter`
  (`text_prefix`), which needs `ray[llm]`.

All three register themselves so the ingress can list the live replicas, and send a control call
(`/metrics`) to a named one (`RoutedRequest.target`); a request re-sent after a replica failed
avoids the replicas that failed it (`RoutedRequest.avoid`).
"""

from __future__ import annotations

import random

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvwise.cluster.prefix_directory import PrefixDirectory
from kvwise.cluster.routed_request import RoutedRequest
from kvwise.cluster.text_prefix import TextPrefixTree


def routed_request(pending: PendingRequest | None) -> RoutedRequest | None:
    if pending is None:
        return None
    return next((arg for arg in pending.args if isinstance(arg, RoutedRequest)), None)


class _Controls:
    """Targets, avoidance and registration, common to the three routers."""

    def _register(self) -> None:
        from kvwise.cluster.router_registry import ACTIVE_ROUTERS  # at call time: see router_registry

        if self._deployment_id is not None:
            ACTIVE_ROUTERS[self._deployment_id.name] = self
        self.sent_to: dict[str, str] = {}  # request id -> the replica it was last sent to

    def replica_ids(self) -> list[str]:
        return [replica_id.to_full_id_str() for replica_id in self.curr_replicas]

    def _narrow(self, candidates: list[RunningReplica], routed: RoutedRequest | None):
        """(candidates left, whether routing is decided): a target decides; failed replicas drop out."""
        if routed is None:
            return candidates, False
        if routed.target is not None:
            return [r for r in candidates if r.replica_id.to_full_id_str() == routed.target], True
        kept = [r for r in candidates if r.replica_id.to_full_id_str() not in routed.avoid]
        return kept or candidates, False

    def answering(self, replica: str, request_id: str) -> None:
        """The ingress has the replica's first message for the request: its prefill is done."""

    def finished(self, replica: str, request_id: str) -> None:
        """The ingress relayed the request's whole response (Ray tells the router a moment later)."""

    def _note_sent(self, pending: PendingRequest, replica_id: ReplicaID) -> None:
        routed = routed_request(pending)
        if routed is not None:
            self.sent_to[routed.request_id] = replica_id.to_full_id_str()
            if len(self.sent_to) > 65536:
                self.sent_to.pop(next(iter(self.sent_to)))


class KVWiseRouter(_Controls, FIFOMixin, RequestRouter):
    def initialize_state(self, block_size: int = 16, decode_weight: float = 64.0, imbalance: int = 8):
        self.directory = PrefixDirectory(block_size, decode_weight, imbalance)
        self._seen_stats: dict[str, int] = {}
        self._request_of: dict[str, str] = {}  # Ray's internal request id -> ours
        self._register()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        self._read_reports(candidate_replicas)
        routed = routed_request(pending_request)
        candidates, decided = self._narrow(candidate_replicas, routed)
        if decided or routed is None or not candidates:
            return [candidates]
        by_id = {replica.replica_id.to_full_id_str(): replica for replica in candidates}
        ranking = self.directory.rank(by_id, routed.blocks, routed.prompt_tokens)
        return [[by_id[choice.replica]] for choice in ranking]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._note_sent(pending_request, replica_id)
        routed = routed_request(pending_request)
        if routed is None or routed.target is not None:
            return
        replica = replica_id.to_full_id_str()
        matched = self.directory.match(replica, routed.blocks)
        uncached = max(0, routed.prompt_tokens - sum(matched.values()) * self.directory.block_size)
        internal = pending_request.metadata.internal_request_id
        self._request_of[internal] = routed.request_id
        self.directory.routed(replica, routed.request_id, routed.blocks, uncached)

    def answering(self, replica: str, request_id: str) -> None:
        self.directory.answering(replica, request_id)

    def finished(self, replica: str, request_id: str) -> None:
        self.directory.completed(replica, request_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        request_id = self._request_of.pop(internal_request_id, None)
        if request_id is not None:
            self.directory.completed(replica_id.to_full_id_str(), request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.directory.forget(replica_id.to_full_id_str())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {replica.replica_id.to_full_id_str() for replica in replicas}
        for replica in list(self.directory.reports):
            if replica not in live:
                self.directory.forget(replica)

    def _read_reports(self, replicas: list[RunningReplica]) -> None:
        """Take each replica's latest routing stats (once per new report)."""
        for replica in replicas:
            stats = replica.routing_stats
            name = replica.replica_id.to_full_id_str()
            if stats and self._seen_stats.get(name) != id(stats):
                self._seen_stats[name] = id(stats)
                self.directory.report(name, stats)


class PowerOfTwoRouter(_Controls, PowerOfTwoChoicesRequestRouter):
    """Ray's power of two choices, with the ingress's controls."""

    def initialize_state(self, **kwargs):
        self._register()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        candidates, decided = self._narrow(candidate_replicas, routed_request(pending_request))
        if decided:
            return [candidates]
        return await super().choose_replicas(candidates, pending_request)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._note_sent(pending_request, replica_id)


class TextPrefixRouter(_Controls, FIFOMixin, RequestRouter):
    """PrefixCacheAffinityRouter's documented policy (see `text_prefix`), its defaults included:
    imbalanced_threshold infinite, match_rate_threshold 0.1."""

    def initialize_state(self, imbalanced_threshold: float = float("inf"), match_rate_threshold: float = 0.1):
        self.imbalanced_threshold, self.match_rate_threshold = imbalanced_threshold, match_rate_threshold
        self.tree = TextPrefixTree()
        self._register()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        routed = routed_request(pending_request)
        candidates, decided = self._narrow(candidate_replicas, routed)
        if decided or routed is None or not candidates:
            return [candidates]
        text = request_text(routed)
        lengths = [self.replica_queue_len_cache.get(r.replica_id) or 0 for r in candidates]
        if not text or max(lengths) - min(lengths) > self.imbalanced_threshold:
            return [random.sample(candidates, min(2, len(candidates)))]
        by_id = {replica.replica_id.to_full_id_str(): replica for replica in candidates}
        matched, holders = self.tree.match(text, by_id)
        chosen = holders if matched / len(text) >= self.match_rate_threshold else self.tree.smallest(by_id)[:1]
        return [[by_id[name] for name in chosen]] if chosen else [candidates]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._note_sent(pending_request, replica_id)
        routed = routed_request(pending_request)
        if routed is not None and routed.target is None:
            self.tree.insert(request_text(routed), replica_id.to_full_id_str())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.tree.remove(replica_id.to_full_id_str())


def request_text(routed: RoutedRequest) -> str:
    """The prompt, or the messages' contents joined (as Ray Serve LLM's router reads them)."""
    if routed.prompt is not None:
        return routed.prompt
    parts = []
    for message in routed.messages or []:
        content = message.get("content") if isinstance(message, dict) else message
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(part.get("text", "") for part in content if isinstance(part, dict))
    return "".join(parts)


ROUTERS = {"kvwise": KVWiseRouter, "pow2": PowerOfTwoRouter, "text-prefix": TextPrefixRouter}
