"""`Scheduler`: continuous batching over the block pool.

Each step gets a token budget. Running requests that are decoding take one token each first;
the rest of the budget goes to prefill chunks (chunked prefill mixed with decode steps). Waiting
requests are admitted in cache-aware order (longest cached prefix first; plain
first-come-first-served once the queue is longer than `fcfs_queue_length`, so nobody starves
under load), and reuse their cached prefix blocks from the radix tree (locked while they run).
The budget then goes to the prefills shortest remaining first: a prompt that is mostly cached
gets its first token in the next step instead of queueing behind a long uncached prompt, which
minimises the mean time to first token (SRPT). A prefill passed over for `STARVATION_STEPS`
steps in a row goes first, so a long prompt cannot be starved by a stream of short ones.
Running slots go round the tenants: the next admission is a request of the tenant running the
fewest, so one tenant's burst cannot hold every slot while another's requests wait.

Memory is checked before it is taken. When a step cannot get the blocks it needs, the prefix
cache gives up unlocked blocks first; if that is not enough, the most recently admitted running
request is preempted: its blocks are released and it goes back to the front of the queue to be
recomputed (its cached prefix usually survives in the tree), or, with a host swap space, its
blocks are copied to host memory and copied back when it runs again.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from kvwise.core.block_pool import BlockPool
from kvwise.core.hashing import Namespace, SegmentedNamespace
from kvwise.core.radix import RadixCache
from kvwise.engine.request import Request, Status
from kvwise.kv.prefix_tiers import PrefixTiers

log = logging.getLogger("kvwise.engine")


@dataclass
class Chunk:
    """Tokens [start, end) of `request.tokens` to compute this step."""

    request: Request
    start: int
    end: int


@dataclass
class Step:
    decodes: list[Chunk] = field(default_factory=list)
    prefills: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def chunks(self) -> list[Chunk]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(chunk.end - chunk.start for chunk in self.chunks)


PLENTY_FREE_FRACTION = 0.25  # whole-request reservations stop when fewer blocks than this stay free
STARVATION_STEPS = 8  # a prefill that got no tokens this many steps in a row is served first


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        tree: RadixCache | None,
        namespace_of,
        token_budget: int = 512,
        max_running: int = 64,
        fcfs_queue_length: int = 32,
        swap=None,
        tiers: PrefixTiers | None = None,
    ):
        """namespace_of(request) -> Namespace: the request's prefix namespace (tenant, model, format).
        tiers: where the tree's evicted blocks went; an admitted prompt's cached prefix continues there."""
        if token_budget < 1 or max_running < 1:
            raise ValueError("token_budget and max_running must be positive")
        self.pool, self.tree, self.namespace_of = pool, tree, namespace_of
        self.block_size = pool.block_size
        self.token_budget, self.max_running, self.fcfs_queue_length = token_budget, max_running, fcfs_queue_length
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.swap = swap  # HostSwap: preempt by spilling to host memory (None: always recompute)
        self.tiers = tiers
        self.recomputed_blocks = 0  # device blocks dropped by recompute preemptions
        self.release_quantized = None  # callable(request, quantized ids), set by the engine
        self.on_admit: list = []  # callables(request), when it is admitted with its cached prefix matched (metrics)

    # ---- queue ---------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def cancel(self, request: Request) -> None:
        """Stop a request wherever it is and free what it holds."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request.swapped is not None:
            self.swap.drop(request.swapped)
            request.swapped = None
        if request in self.running:
            self.running.remove(request)
            self._release(request)
        request.status = Status.CANCELLED

    def finish(self, request: Request) -> None:
        """A finished request's full prompt blocks go to the prefix cache, then its blocks are released."""
        self.running.remove(request)
        if self.tree is not None and not self._compresses(request):
            full = request.computed // self.block_size * self.block_size
            self._insert(request, request.tokens[:full])
        self._release(request)
        request.status = Status.FINISHED

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> Step:
        step, budget = Step(), self.token_budget
        for request in list(self.running):
            if budget == 0:
                break
            if not request.prefilling and request not in step.preempted:
                budget -= self._schedule_decode(request, step, may_preempt=True)
        # a step that had to preempt admits nobody: the victim would come straight back
        admitted = [] if step.preempted else self._admit_waiting(budget)
        prefilling = [r for r in self.running if r.prefilling]
        budget = self._schedule_prefills(prefilling, budget, step)
        scheduled = {id(chunk.request) for chunk in step.prefills}
        unadmitted = [r for r in admitted if id(r) not in scheduled]
        for request in reversed(unadmitted):  # no budget or no memory for it yet: back to the front
            self._unadmit(request)
        if unadmitted:  # their prefixes were locked: a running prefill may find its blocks now
            budget = self._schedule_prefills([r for r in prefilling if id(r) not in scheduled], budget, step)
        for request in admitted:
            if id(request) in scheduled:
                for listener in self.on_admit:
                    listener(request)
        while not step.chunks and len(self.running) > 1:
            # every running request is stuck mid-prefill waiting for blocks the others hold:
            # give the newest one's back so the rest can move (without this nothing ever would)
            self._preempt(self.running[-1], step)
            budget = self._schedule_prefills([r for r in self.running if r.prefilling], budget, step)
        if not step.preempted:  # after everyone running: the memory goes to them first, as before
            budget = self._swap_in_waiting(budget, step)
        scheduled = {id(chunk.request) for chunk in step.prefills}
        for request in prefilling:
            request.skipped_steps = 0 if id(request) in scheduled else request.skipped_steps + 1
        return step

    def _schedule_prefills(self, requests: list[Request], budget: int, step: Step) -> int:
        for request in self._prefill_order(requests):
            budget = self._schedule_prefill(request, budget, step)
        return budget

    def _admit_waiting(self, budget: int) -> list[Request]:
        """Admit waiting requests, in cache-aware order, while their uncached prompt tokens fit
        `budget`; stops at one preempted to host memory (`_swap_in_waiting` resumes those)."""
        admitted, wanted = [], 0
        while wanted < budget and self.waiting and len(self.running) < self.max_running:
            request = self._next_waiting()
            if request.swapped is not None:
                self.waiting.appendleft(request)
                break
            self._admit(request)
            admitted.append(request)
            wanted += request.prefill_target - request.computed
        return admitted

    def _swap_in_waiting(self, budget: int, step: Step) -> int:
        """Copy requests preempted to host memory back and continue them in this step (a step
        without chunks would stop the engine); returns the budget left."""
        while budget > 0 and self.waiting and self.waiting[0].swapped is not None:
            if len(self.running) >= self.max_running or not self._swap_in(self.waiting[0]):
                break
            request = self.waiting.popleft()
            if request.swapped is None and request.status is Status.WAITING:  # the copy failed: recompute it
                self._admit(request)
                budget = self._schedule_prefill(request, budget, step)
                continue
            if request.prefilling:
                budget = self._schedule_prefill(request, budget, step)
            else:
                budget -= self._schedule_decode(request, step)
        return budget

    def _schedule_decode(self, request: Request, step: Step, may_preempt: bool = False) -> bool:
        """One decode token for `request` if its block can be had; True when scheduled."""
        if not self._reserve(request, request.computed + 1, step, may_preempt):
            return False
        step.decodes.append(Chunk(request, request.computed, request.computed + 1))
        return True

    @staticmethod
    def _prefill_order(requests: list[Request]) -> list[Request]:
        """Starving prefills first, then shortest remaining first (ties: running order)."""
        return sorted(
            requests, key=lambda r: (r.skipped_steps < STARVATION_STEPS, r.prefill_target - r.computed)
        )

    def _unadmit(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.computed = request.reused = 0
        request.status = Status.WAITING
        self.waiting.appendleft(request)

    def complete(self, chunk: Chunk, token: int | None) -> None:
        """Record a computed chunk; `token` is what was sampled after it (None mid-prompt)."""
        request = chunk.request
        request.computed = chunk.end
        if token is not None and not request.prefilling:
            request.output.append(token)
        if self.tree is not None and chunk.start < len(request.prompt) and not self._compresses(request):
            # cache prompt blocks as soon as they are computed, so requests running at the same
            # time share them (as vLLM and SGLang do), not only those that come after this one ends
            full = min(chunk.end, len(request.prompt)) // self.block_size * self.block_size
            self._insert(request, request.prompt[:full])

    def _insert(self, request: Request, tokens: list[int]) -> None:
        """Cache a request's computed full blocks; a key that may only read the shared namespace
        caches nothing while its shared segment is not published there already."""
        namespace = self.namespace_of(request)
        segment = request.shared_prefix_tokens // self.block_size * self.block_size
        if segment and not request.may_publish_shared:
            if self.tree.match_prefix(tokens[:segment], namespace, touch=False).length < min(segment, len(tokens)):
                return
        self.tree.insert(tokens, request.blocks, namespace)

    def _schedule_prefill(self, request: Request, budget: int, step: Step) -> int:
        if budget == 0 or request not in self.running:
            return budget
        end = min(request.prefill_target, request.computed + budget)
        if end > request.computed and not self._reserve(request, end, step):
            # a shorter chunk in the blocks that are free (the prefix cache gave up what it could)
            room = (len(request.blocks) + self.pool.num_free) * self.block_size + request.kv_offset
            end = min(end, room)
            if end <= request.computed or not self._reserve(request, end, step):
                return budget
        if end > request.computed:
            step.prefills.append(Chunk(request, request.computed, end))
            budget -= end - request.computed
        return budget

    def _next_waiting(self) -> Request:
        """The next request to admit: a preempted one first (work already taken on), else one of
        the tenant holding the fewest running slots, then cache-aware (or FCFS) within those."""
        if self.waiting[0].preemptions:
            return self.waiting.popleft()
        candidates = self._fair_candidates()
        if self.tree is None or len(self.waiting) > self.fcfs_queue_length:
            best = candidates[0]
        else:
            best = max(candidates, key=self._cached_length)
        self.waiting.remove(best)
        return best

    def _cached_length(self, request: Request) -> int:
        return self.tree.match_prefix(request.prompt[:-1], self.namespace_of(request), touch=False).length

    def _fair_candidates(self) -> list[Request]:
        """Waiting requests of the tenants with the fewest running requests, in queue order: running
        slots go round the active tenants, so one tenant's burst cannot take every slot."""
        running: dict[str, int] = {}
        for request in self.running:
            running[request.tenant] = running.get(request.tenant, 0) + 1
        fewest = min(running.get(request.tenant, 0) for request in self.waiting)
        return [request for request in self.waiting if running.get(request.tenant, 0) == fewest]

    def _admit(self, request: Request) -> None:
        request.status = Status.RUNNING
        if self.tree is not None:
            namespace = self.namespace_of(request)
            match = self.tree.match_prefix(request.prompt[:-1], namespace)
            if self.tiers is not None and self._promote(request, namespace, match):
                match = self.tree.match_prefix(request.prompt[:-1], namespace)
            self.tree.lock(match.nodes)
            self.pool.incref(match.blocks)
            request.locked_nodes, request.blocks = match.nodes, match.blocks
            request.computed = request.reused = match.length
        self.running.append(request)

    def _promote(self, request: Request, namespace, match) -> bool:
        """Continue the prompt's device match in the tiers; True when blocks came back. Only free
        blocks and the prefix cache's own make room: promotion never preempts anyone."""
        usable = (len(request.prompt) - 1) // self.block_size
        if len(match.nodes) >= usable:
            return False
        self.tree.lock(match.nodes)  # making room must not evict the prefix being continued
        try:
            return bool(self.tiers.promote(request.prompt, namespace, len(match.nodes), usable, self._room_for))
        finally:
            self.tree.unlock(match.nodes)

    def _room_for(self, count: int) -> int:
        if not self.pool.can_allocate(count):
            self.tree.evict(count - self.pool.num_free)
        return min(count, self.pool.num_free)

    # ---- memory ------------------------------------------------------------------------------
    def _reserve(self, request: Request, tokens: int, step: Step, may_preempt: bool = False) -> bool:
        """Blocks for `tokens` tokens of `request`: evicts cached prefixes, then (for requests
        already decoding, never to admit a newcomer) preempts the most recently admitted one."""
        needed = -(-(tokens - request.kv_offset) // self.block_size) - len(request.blocks)
        if needed <= 0:
            return True
        while not self.pool.can_allocate(needed):
            # cached prefixes first (a preempted request's prompt blocks are cached, so they go too)
            if self.tree is not None:
                self.tree.evict(needed - self.pool.num_free)
                if self.pool.can_allocate(needed):
                    break
            victim = next((r for r in reversed(self.running) if r is not request), None) if may_preempt else None
            if victim is None:
                return False
            self._preempt(victim, step)
        if not request.reserved and self._reserve_whole(request):
            return True
        request.reserved = True
        request.blocks += self.pool.allocate(needed)
        return True

    def _reserve_whole(self, request: Request) -> bool:
        """While memory is plentiful, a request's first allocation takes consecutive blocks for
        all its tokens (prompt + max_tokens): the CPU runner then reads its KV as one slice of
        the pool instead of gathering blocks every layer and step. Under pressure, or without a
        long enough free run, blocks come one step's need at a time."""
        request.reserved = True
        total = -(-(len(request.prompt) + request.params.max_tokens) // self.block_size) - len(request.blocks)
        if self.pool.num_free - total < self.pool.num_blocks * PLENTY_FREE_FRACTION:
            return False
        run = self.pool.allocate_contiguous(total)
        if run is None:
            return False
        request.blocks += run
        return True

    def _preempt(self, request: Request, step: Step) -> None:
        """Spill the request's KV to host memory when the swap space has room (it resumes where it
        stopped); otherwise drop it and recompute prompt and output later (the output is kept)."""
        swappable = request.blocks and min(request.blocks) >= 0  # quantized blocks are recomputed
        swapped = None
        if self.swap is not None and swappable and self.swap.can_hold(len(request.blocks)):
            try:  # copied before anything changes: a failed copy leaves no block or lock behind
                swapped = self.swap.swap_out(request.blocks)
            except Exception:  # noqa: BLE001 - host memory refused: recompute instead
                log.exception("swapping out %s failed; it will be recomputed", request.request_id)
        self.running.remove(request)
        if swapped is not None:
            request.swapped = swapped
            self._release(request)
            request.reserved = True
        else:
            self.recomputed_blocks += len(request.blocks)
            self._release(request)
            self._reset_for_recompute(request)
        request.status = Status.WAITING
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)
        step.preempted.append(request)
        step.decodes = [chunk for chunk in step.decodes if chunk.request is not request]
        step.prefills = [chunk for chunk in step.prefills if chunk.request is not request]

    def _swap_in(self, request: Request) -> bool:
        needed = request.swapped.num_blocks
        if not self.pool.can_allocate(needed) and self.tree is not None:
            self.tree.evict(needed - self.pool.num_free)
        if not self.pool.can_allocate(needed):
            return False
        request.blocks = self.pool.allocate(needed)
        try:
            self.swap.swap_in(request.swapped, request.blocks)
        except Exception:  # noqa: BLE001 - give the blocks back and recompute it instead
            log.exception("swapping in %s failed; it will be recomputed", request.request_id)
            self.pool.release(request.blocks)
            self.recomputed_blocks += len(request.blocks)
            request.blocks = []
            self.swap.drop(request.swapped)
            request.swapped, request.reserved = None, False
            self._reset_for_recompute(request)
            return True  # taken off the swap: admitted now as a recompute
        request.swapped, request.status = None, Status.RUNNING
        self.running.append(request)
        return True

    @staticmethod
    def _reset_for_recompute(request: Request) -> None:
        """Its KV is gone: compute prompt and output again when admitted (the output is kept)."""
        request.computed = request.reused = request.kv_offset = 0
        request.compacted_positions = None
        request.recompute_to = len(request.tokens) if request.output else None

    def shrink(self, request: Request, kv_tokens: int) -> None:
        """Give back the blocks past a request's first `kv_tokens` KV slots (after its eviction)."""
        keep = -(-kv_tokens // self.block_size)
        if keep < len(request.blocks):
            self._give_back(request, request.blocks[keep:])
            request.blocks = request.blocks[:keep]

    @staticmethod
    def _compresses(request: Request) -> bool:
        """Its private blocks hold its own compressed state: never cache them as the prompt's."""
        return request.kv is not None and request.kv.active

    def _release(self, request: Request) -> None:
        request.reserved = False
        if self.tree is not None and request.locked_nodes:
            self.tree.unlock(request.locked_nodes)
        if request.blocks:
            self._give_back(request, request.blocks)
        request.blocks, request.locked_nodes = [], []

    def _give_back(self, request: Request, blocks: list[int]) -> None:
        """Release device blocks, and quantized ones (negative table entries) to their QuantPool."""
        device = [block for block in blocks if block >= 0]
        if device:
            self.pool.release(device)
        if len(device) < len(blocks):
            self.release_quantized(request, [-1 - block for block in blocks if block < 0])


class TenantNamespaces:
    """namespace_of for a scheduler: each request's own tenant's namespace, keyed with the server's
    secret, with its marked leading segment (whole blocks of it) in the shared namespace.

    A request's namespace is fixed the first time it is asked for, so a key rotation (`rekey`)
    changes the identity of new requests only: a running request inserts its blocks under the
    keys it matched them with."""

    def __init__(self, model_id: str, kv_format: str = "", secret: bytes = b"", block_size: int = 16):
        self.model_id, self.kv_format, self.block_size = model_id, kv_format, block_size
        self.secret = secret

    def rekey(self, secret: bytes) -> None:
        self.secret = secret  # one assignment: a request built concurrently gets the old or the new

    def __call__(self, request) -> Namespace | SegmentedNamespace:
        if request.namespace is None:
            own = Namespace(self.model_id, request.tenant, self.kv_format, self.secret)
            request.namespace = own.with_shared_prefix(request.shared_prefix_tokens // self.block_size)
        return request.namespace


def default_namespace(model_id: str, kv_format: str = "", secret: bytes = b"", block_size: int = 16):
    return TenantNamespaces(model_id, kv_format, secret, block_size)
