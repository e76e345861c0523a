"""`AsyncEngine`: the engine loop on its own thread, fed and read from asyncio.

The HTTP handlers never touch the engine: they put commands (add, abort) on a thread-safe queue
and read their requests' tokens from an asyncio.Queue each. The engine thread drains the
commands, runs one step, and hands each TokenEvent to its request's queue through the event
loop. One thread owns the scheduler, the pool and the model, so none of them needs a lock.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from kvwise.engine.core import EngineCore, TokenEvent
from kvwise.engine.request import Request, Status
from kvwise.server.metrics import ServerMetrics
from kvwise.server.protocol import OpenAIError
from kvwise.server.stats_log import StatsLog

log = logging.getLogger("kvwise.server")


class EngineFailure(Exception):
    """The engine could not run a step; the requests in it are cancelled."""


class AsyncEngine:
    def __init__(
        self,
        core: EngineCore,
        max_queue: int = 256,
        metrics: ServerMetrics | None = None,
        fair: bool = True,
        shared_timing_pad: bool = False,
        tenants: int = 1,
        stats_log: StatsLog | None = None,
    ):
        """fair: each active tenant may hold at most an equal share of the queue, so one tenant
        cannot fill it; the tenant over its share gets the 429. shared_timing_pad: a request that
        hit the shared namespace gets its first token no sooner than a miss would have. tenants:
        how many tenants the server knows (its key file's)."""
        if max_queue < 1:
            raise ValueError(f"--max-queue must be >= 1, got {max_queue}")
        self.core, self.max_queue, self.fair, self.shared_timing_pad = core, max_queue, fair, shared_timing_pad
        self.tenants = tenants
        self._held: dict[Request, list] = {}  # padded requests' events, released after their pad
        self.metrics = metrics or ServerMetrics(core)
        self.stats_log = stats_log or StatsLog(core, interval_seconds=0)
        self.accepting = True
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._pending_adds = 0  # requests handed to the thread and not yet in the scheduler
        self._pending_lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[Request, asyncio.Queue] = {}
        self._queued_tenants: dict[Request, str] = {}  # submitted and not yet admitted to run
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="kvwise-engine", daemon=True)

    # ---- called from the event loop ------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Requests not yet admitted. Preempted requests wait too, but they are work the server
        already took on: counting them would answer 429 under memory pressure alone."""
        waiting = list(self.core.scheduler.waiting)  # one C-level copy: the engine thread mutates the deque
        return sum(1 for request in waiting if not request.preemptions) + self._pending_adds

    def submit(self, requests: list[Request]) -> asyncio.Queue:
        """Queue requests; their TokenEvents (or an EngineFailure) arrive on the returned queue."""
        if not self.accepting:
            raise OpenAIError(503, "the server is shutting down", code="shutting_down")
        if not self.alive:  # nothing would ever answer these requests
            raise OpenAIError(503, "the engine thread has stopped; see the server log", code="engine_down")
        if self.queue_depth + len(requests) > self.max_queue:
            self.metrics.rejected.inc()
            raise OpenAIError(
                429,
                f"the server's queue is full ({self.max_queue} requests waiting); retry shortly",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        tenant = requests[0].tenant if requests else None
        if self.fair and tenant is not None:
            queued, active = self._queued_by_tenant()
            # with several tenants configured, nobody takes more than half: a newcomer finds room
            sharing = max(len(active | {tenant}), min(2, self.tenants))
            share = max(1, self.max_queue // sharing)
            if queued.get(tenant, 0) + len(requests) > share:
                self.metrics.rejected.inc()
                raise OpenAIError(
                    429,
                    f"this tenant already has {queued.get(tenant, 0)} requests waiting, its fair share of the "
                    f"queue is {share}; retry shortly",
                    code="tenant_queue_full",
                    headers={"Retry-After": "1"},
                )
        events: asyncio.Queue = asyncio.Queue()
        for request in requests:
            self._queues[request] = events
            self._queued_tenants[request] = request.tenant
        with self._pending_lock:
            self._pending_adds += len(requests)
        self._commands.put(("add", requests))
        self._wake.set()
        return events

    def _queued_by_tenant(self) -> tuple[dict[str, int], set[str]]:
        """({tenant: requests not yet running}, tenants with any request in the server)."""
        running = {request.tenant for request in list(self.core.scheduler.running)}
        queued: dict[str, int] = {}
        for request, tenant in list(self._queued_tenants.items()):
            if request.status is Status.WAITING and not request.preemptions:
                queued[tenant] = queued.get(tenant, 0) + 1
            else:
                self._queued_tenants.pop(request, None)
        return queued, running | set(queued)

    def call_soon(self, function) -> None:
        """Run function() on the engine thread between two steps (a key rotation, say)."""
        self._commands.put(("call", function))
        self._wake.set()

    def abort(self, requests: list[Request]) -> None:
        """Cancel requests (a client went away); their blocks are freed on the engine thread."""
        self._commands.put(("abort", requests))
        self._wake.set()

    async def drain(self, poll_seconds: float = 0.05) -> None:
        """Graceful shutdown: refuse new requests, let the running and queued ones finish, stop."""
        self.accepting = False
        self._stopping = True
        self._wake.set()
        while self._thread.is_alive():
            await asyncio.sleep(poll_seconds)

    # ---- the engine thread ---------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() or not self._thread.ident  # not started yet counts as alive

    def _run(self) -> None:
        while True:
            try:
                if not self._turn():
                    return
            except Exception as error:  # a failed step must not kill the server: fail its requests
                log.exception("engine step failed")
                self._fail_all(error)

    def _turn(self) -> bool:
        """Apply commands, run one step, deliver its tokens; False once drained and stopping."""
        self._apply_commands()
        if not self.core.has_work:
            if self._stopping and self._commands.empty():
                return False
            self._wake.wait(0.05)
            self._wake.clear()
            return True
        events = self.core.step()
        for event in events:
            self.metrics.on_token(event)
            self._deliver(event.request, event)
            if event.finish_reason is not None:
                self.stats_log.finished(event.request, event.finish_reason)
        self.stats_log.maybe_log(self.metrics)
        return True

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "call":
                try:
                    payload()
                except Exception:  # an operator's command must not fail the requests in flight
                    log.exception("a command on the engine thread failed")
                continue
            for request in payload:
                if kind == "add":
                    with self._pending_lock:
                        self._pending_adds -= 1
                    self.core.add(request)
                elif not request.done:
                    self.core.abort(request)
                    self.metrics.on_cancelled(request)
                    self.stats_log.finished(request, "cancelled")
                    self._queues.pop(request, None)

    def _fail_all(self, error: Exception) -> None:
        """Every request with a waiting client gets the failure (some may have left the scheduler
        before the error), and everything the scheduler holds is released."""
        failure = EngineFailure(f"the engine failed: {type(error).__name__}: {error}")
        for request in list(self.core.scheduler.running) + list(self.core.scheduler.waiting):
            self.core.abort(request)
        for request in list(self._queues):
            self.metrics.requests.labels("failed").inc()
            self._deliver(request, failure)

    def _deliver(self, request: Request, item: TokenEvent | EngineFailure) -> None:
        events = self._queues.get(request)
        if events is None:
            return
        if isinstance(item, TokenEvent) and item.finish_reason == "error":
            self.metrics.requests.labels("failed").inc()
            item = EngineFailure(request.error or "internal error while computing this request")
        if isinstance(item, EngineFailure) or item.finish_reason is not None:
            del self._queues[request]
        pad = self._timing_pad(request, item)
        self._loop.call_soon_threadsafe(self._hand_over, request, events, item, pad)

    def _timing_pad(self, request: Request, item) -> float:
        """Seconds to hold a request's first token: how much longer its step would have taken had
        its shared-namespace hit been a miss (`EngineCore.hit_pad_seconds`, which says how that is
        estimated), so a timing probe cannot tell that another tenant cached the prefix. Called
        right after the step that produced `item`. Only tokens found in the shared segment count: a
        request with no shared segment (every isolated tenant's) or whose segment missed is never held."""
        if not self.shared_timing_pad or not isinstance(item, TokenEvent) or len(request.output) != 1:
            return 0.0
        shared_hit_tokens = self._shared_hit_tokens(request)
        return self.core.hit_pad_seconds(shared_hit_tokens) if shared_hit_tokens > 0 else 0.0

    def _shared_hit_tokens(self, request: Request) -> int:
        """Of the prompt tokens found in the prefix cache, those in its shared segment."""
        segment = request.shared_prefix_tokens // self.core.kv.block_size * self.core.kv.block_size
        return min(request.reused, segment)

    def cached_tokens(self, request: Request) -> int:
        """Prompt tokens found in the prefix cache, for `usage`. With timing padding on, hits in the
        shared namespace are left out: the count would tell a client what the padding hides."""
        hidden = self._shared_hit_tokens(request) if self.shared_timing_pad else 0
        return request.reused - hidden

    def _hand_over(self, request: Request, events: asyncio.Queue, item, pad: float) -> None:
        """On the event loop: queue `item` for its handler, holding a padded request's events back
        (in order) until its pad has passed."""
        held = self._held.get(request)
        if held is not None:
            held.append(item)
        elif pad > 0:
            self._held[request] = [item]
            self._loop.call_later(pad, self._release_held, request, events)
        else:
            events.put_nowait(item)

    def _release_held(self, request: Request, events: asyncio.Queue) -> None:
        for item in self._held.pop(request, []):
            events.put_nowait(item)
