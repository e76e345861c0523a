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

Memory belongs to the `KVCacheManager`: the scheduler asks it first (`can_allocate`,
`can_swap_out`, `can_swap_in`) and then acts. When a step cannot get the blocks it needs (the
manager has already given up unlocked cached prefixes), the most recently admitted running
request is preempted: it goes back to the front of the queue, its blocks copied to host memory
when the swap space has room (it resumes where it stopped), otherwise released to be recomputed
(its cached prefix usually survives in the tree).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvwise.engine.kv_manager import KVCacheManager
from kvwise.engine.request import Request, Status


@dataclass
class Chunk:
    """Tokens [start, end) of `request.tokens` to compute this step."""

    request: Request
    start: int
    end: int

    @property
    def owner(self) -> Request:
        """The request this chunk is work for (a reconstruction pass computes for another)."""
        return self.request


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


STARVATION_STEPS = 8  # a prefill that got no tokens this many steps in a row is served first


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        token_budget: int = 512,
        max_running: int = 64,
        fcfs_queue_length: int = 32,
    ):
        """kv: the KV memory every decision here asks first (blocks, prefix cache, swap)."""
        if token_budget < 1 or max_running < 1:
            raise ValueError("token_budget and max_running must be positive")
        self.kv = kv
        self.token_budget, self.max_running, self.fcfs_queue_length = token_budget, max_running, fcfs_queue_length
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.memory_stalls = 0  # prefill chunks that found no blocks: memory held a request back
        self.on_admit: list = []  # callables(request), when it is admitted with its cached prefix matched (metrics)
        self.on_admitting: list = []  # callables(request), before its prefix is matched (the KV controller)

    # ---- queue ---------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def cancel(self, request: Request) -> None:
        """Stop a request wherever it is and free what it holds."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self.kv.free(request)
        request.status = Status.CANCELLED

    def finish(self, request: Request) -> None:
        """A finished request's full prompt blocks go to the prefix cache, then its blocks are released."""
        self.running.remove(request)
        self.kv.cache_prompt(request, request.computed)
        self.kv.free(request)
        request.status = Status.FINISHED

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> Step:
        step, budget = Step(), self.token_budget
        for request in list(self.running):
            if budget == 0:
                break
            if not request.prefilling and request not in step.preempted and request.reconstruction is None:
                budget -= self._schedule_decode(request, step, may_preempt=True)
        # a step that had to preempt admits nobody: the victim would come straight back
        admitted = [] if step.preempted else self._admit_waiting(budget)
        prefilling = [r for r in self.running if r.prefilling or r.reconstruction is not None]
        budget = self._schedule_prefills(prefilling, budget, step)
        scheduled = {chunk.owner for chunk in step.prefills}
        unadmitted = [r for r in admitted if r not in scheduled]
        for request in reversed(unadmitted):  # no budget or no memory for it yet: back to the front
            self._unadmit(request)
        if unadmitted:  # their prefixes were locked: a running prefill may find its blocks now
            budget = self._schedule_prefills([r for r in prefilling if r not in scheduled], budget, step)
        for request in admitted:
            if request in scheduled:
                for listener in self.on_admit:
                    listener(request)
        while not step.chunks and len(self.running) > 1:
            # every running request is stuck mid-prefill waiting for blocks the others hold:
            # give the newest one's back so the rest can move (without this nothing ever would)
            self._preempt(self.running[-1], step)
            waiting_work = [r for r in self.running if r.prefilling or r.reconstruction is not None]
            budget = self._schedule_prefills(waiting_work, budget, step)
        if not step.preempted:  # after everyone running: the memory goes to them first, as before
            budget = self._swap_in_waiting(budget, step)
        scheduled = {chunk.owner for chunk in step.prefills}
        for request in prefilling:
            request.skipped_steps = 0 if request in scheduled else request.skipped_steps + 1
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
        """Starving prefills first, then shortest remaining first (ties: running order); a
        reconstruction pass counts as the prefill of its remaining tokens."""

        def remaining(request: Request) -> int:
            if request.reconstruction is not None:
                return request.reconstruction.remaining
            return request.prefill_target - request.computed

        return sorted(requests, key=lambda r: (r.skipped_steps < STARVATION_STEPS, remaining(r)))

    def _unadmit(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.computed = request.reused = 0
        request.status = Status.WAITING
        self.waiting.appendleft(request)

    def complete(self, chunk: Chunk, token: int | None) -> None:
        """Record a computed chunk; `token` is what was sampled after it (None mid-prompt)."""
        request = chunk.request
        request.computed = chunk.end
        if token is not None and not request.prefilling:
            request.output.append(token)
        if chunk.start < len(request.prompt):
            # cache prompt blocks as soon as they are computed, so requests running at the same
            # time share them (as vLLM and SGLang do), not only those that come after this one ends
            self.kv.cache_prompt(request, min(chunk.end, len(request.prompt)))

    def _schedule_prefill(self, request: Request, budget: int, step: Step) -> int:
        if budget == 0 or request not in self.running:
            return budget
        if request.reconstruction is not None:  # its pass's blocks are borrowed already
            chunk = request.reconstruction.next_chunk(budget)
            step.prefills.append(chunk)
            return budget - (chunk.end - chunk.start)
        end = min(request.prefill_target, request.computed + budget)
        if request.compress_upto is not None and request.computed < request.compress_upto:
            end = min(end, request.compress_upto)  # a chunk ends there: the document is compressed first
        if request.forced_from is not None:  # forced-token decoding from there
            end = min(end, max(request.forced_from, request.computed + 1))
        if end > request.computed and not self._reserve(request, end, step):
            # a shorter chunk in the blocks that are free (the prefix cache gave up what it could)
            end = min(end, self.kv.fit_tokens(request))
            if end <= request.computed or not self._reserve(request, end, step):
                self.memory_stalls += 1
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
        if not self.kv.prefix_caching or len(self.waiting) > self.fcfs_queue_length:
            best = candidates[0]
        else:
            best = max(candidates, key=self.kv.cached_length)
        self.waiting.remove(best)
        return best

    def _fair_candidates(self) -> list[Request]:
        """Waiting requests of the tenants with the fewest running requests, in queue order: running
        slots go round the active tenants, so one tenant's burst cannot take every slot."""
        running: dict[str, int] = {}
        for request in self.running:
            running[request.tenant] = running.get(request.tenant, 0) + 1
        fewest = min(running.get(request.tenant, 0) for request in self.waiting)
        return [request for request in self.waiting if running.get(request.tenant, 0) == fewest]

    def _admit(self, request: Request) -> None:
        for listener in self.on_admitting:
            listener(request)
        request.status = Status.RUNNING
        request.computed = self.kv.match(request)
        self.running.append(request)

    # ---- memory ------------------------------------------------------------------------------
    def _reserve(self, request: Request, tokens: int, step: Step, may_preempt: bool = False) -> bool:
        """Blocks for `tokens` tokens of `request`: the manager evicts cached prefixes, then (for
        requests already decoding, never to admit a newcomer) the most recently admitted running
        request is preempted."""
        while not self.kv.can_allocate(request, tokens):
            victim = next((r for r in reversed(self.running) if r is not request), None) if may_preempt else None
            if victim is None:
                return False
            self._preempt(victim, step)
        self.kv.allocate(request, tokens)
        return True

    def _preempt(self, request: Request, step: Step) -> None:
        """Spill the request's KV to host memory when the swap space has room (it resumes where it
        stopped); otherwise drop it and recompute prompt and output later (the output is kept)."""
        swapped = self.kv.can_swap_out(request) and self.kv.swap_out(request)
        self._send_back(request, recompute=not swapped)
        step.preempted.append(request)
        step.decodes = [chunk for chunk in step.decodes if chunk.owner is not request]
        step.prefills = [chunk for chunk in step.prefills if chunk.owner is not request]

    def requeue_for_recompute(self, request: Request) -> None:
        """Release a running request's KV and put it first in the queue, to be computed again (after
        a step, when memory it needs for more than a moment is held by others)."""
        self._send_back(request, recompute=True)

    def _send_back(self, request: Request, recompute: bool) -> None:
        """A running request goes first in the queue: a preemption (its KV dropped when `recompute`)."""
        if request in self.running:
            self.running.remove(request)
        if recompute:
            self.kv.free(request, recompute=True)
            self._reset_for_recompute(request)
        request.status = Status.WAITING
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def _swap_in(self, request: Request) -> bool:
        """False when its blocks cannot be had yet; True when it left the swap: running again, or
        (the copy failed) waiting to be recomputed."""
        if not self.kv.can_swap_in(request):
            return False
        if self.kv.swap_in(request):
            request.status = Status.RUNNING
            self.running.append(request)
        else:
            self._reset_for_recompute(request)
        return True

    @staticmethod
    def _reset_for_recompute(request: Request) -> None:
        """Its KV is gone: compute prompt and output again when admitted (the output is kept)."""
        request.computed = request.reused = 0
        request.recompute_to = len(request.tokens) if request.output else None
