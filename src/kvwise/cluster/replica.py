"""`EngineReplica`: one kvwise engine and its OpenAI app, as a Ray Serve deployment's replica.

The ingress forwards each HTTP request unchanged (`RoutedRequest`); the replica runs it through
the single server's own app in-process (`asgi_bridge`) and streams the response back, so every
endpoint, error and tenant rule is the single server's. Ray Serve asks each replica for its
routing stats every period (`record_routing_stats`): which blocks its device and host tier hold,
which it published to the shared tier, and its load. Block names only, never text.
"""

from __future__ import annotations

import logging
import time

import torch

from kvwise.cluster.asgi_bridge import asgi_call
from kvwise.cluster.prefix_directory import DEVICE, HOST, SHARED, short_key
from kvwise.cluster.routed_request import KeySpace, RoutedRequest

log = logging.getLogger("kvwise.cluster")

REPORTED_PUBLISHED = 8192  # most recent published blocks a report carries


class EngineReplica:
    def __init__(self, args, keys, torch_threads: int | None = None):
        from kvwise.server.serve import build_app

        if torch_threads:
            torch.set_num_threads(torch_threads)
        logging.basicConfig(level=getattr(args, "log_level", "info").upper())
        self.app = build_app(args, keys=keys)
        self.engine = self.app.state.engine
        self.core = self.engine.core
        self.engine.start()
        self.replica_id = _replica_id()
        self.started = time.time()

    # ---- the ingress's calls ---------------------------------------------------------------------
    async def call(self, routed: RoutedRequest):
        """The response to one forwarded HTTP request: {"status", "headers", "replica"}, then
        {"body": bytes} chunks as the app sends them."""
        messages = asgi_call(self.app, routed.method, routed.path, routed.query, routed.headers, routed.body)
        try:
            async for message in messages:
                if "status" in message:
                    message["replica"] = self.replica_id
                yield message
        finally:
            await messages.aclose()

    async def describe(self, routed: RoutedRequest | None = None) -> dict:
        """What the ingress needs to name this replica's blocks and tokenize as it does."""
        namespaces = self.core.kv.namespace_of
        return {
            "replica": self.replica_id,
            "key_space": KeySpace(namespaces.model_id, namespaces.kv_format, self.core.kv.block_size),
            "vocab_size": self.core.vocab_size,
            "max_positions": self.core.max_positions,
        }

    async def metrics(self, routed: RoutedRequest | None = None) -> tuple[str, str]:
        """(replica id, Prometheus text of this replica)."""
        text = self.engine.metrics.render()
        return self.replica_id, text.decode() if isinstance(text, bytes) else text

    def check_health(self) -> None:
        """Ray Serve calls it periodically; a replica whose engine thread died is restarted."""
        if not self.engine.alive:
            raise RuntimeError("the engine thread has stopped")

    # ---- Ray Serve's routing stats ---------------------------------------------------------------
    def record_routing_stats(self) -> dict:
        reported_at = time.time()  # before reading the state: the report speaks for that moment on
        snapshot = self.core.kv.routing_snapshot(REPORTED_PUBLISHED)
        device = [short_key(key) for key in snapshot.device]
        host = [short_key(key) for key in snapshot.host]
        published = [short_key(key) for key in snapshot.published]
        restore = self._restore_costs(snapshot.restore_seconds_per_block)
        scheduler = self.core.scheduler
        waiting, running = list(scheduler.waiting), list(scheduler.running)
        queued = sum(max(0, len(request.prompt) - self._settled(request)) for request in waiting + running)
        return {
            DEVICE: device,
            HOST: host,
            "published": published,
            "queued_prefill_tokens": queued,
            "running": len(running),
            "waiting": self.engine.queue_depth,
            "restore_cost": restore,
            "reported_at": reported_at,
        }

    def _settled(self, request) -> int:
        """Prompt tokens a request will not compute: those computed, or for one not yet started,
        those its device prefix cache holds (a hit waiting in the queue is little work)."""
        if request.computed:
            return request.computed
        try:
            return self.core.kv.cached_length(request)
        except Exception:  # the engine thread changed the tree meanwhile: count it all as work
            return 0

    def _restore_costs(self, seconds_per_block: dict[str, float]) -> dict[str, float]:
        """Restoring a block from a tier, as a share of computing it here (measured both ways)."""
        per_token = self.core.prefill_seconds_per_token()
        if not per_token:
            return {}
        compute = per_token * self.core.kv.block_size
        names = {"host": HOST, "redis": SHARED}
        return {names[name]: seconds / compute for name, seconds in seconds_per_block.items() if name in names}


def _replica_id() -> str:
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.to_full_id_str()
    except Exception:  # outside Ray Serve (tests of the class itself)
        return "local"
