"""Continuous batching: budgets, chunked prefill, cache-aware order, preemption, no leaks."""

from __future__ import annotations

from kvwise.core.block_pool import BlockPool
from kvwise.core.radix import RadixCache
from kvwise.engine.block_table import BlockTable
from kvwise.engine.kv_manager import KVCacheManager
from kvwise.engine.namespaces import default_namespace
from kvwise.engine.request import Request, Status
from kvwise.engine.sampling import SamplingParams
from kvwise.engine.scheduler import Scheduler

BLOCK = 4


def make(num_blocks=64, budget=16, **options):
    pool = BlockPool(num_blocks, BLOCK)
    tree = RadixCache(pool)
    return pool, tree, Scheduler(KVCacheManager(pool, tree, default_namespace("m")), token_budget=budget, **options)


def run_step(scheduler, step, max_tokens=3):
    """Pretend to compute: every chunk that ends a prompt or decodes samples token 7."""
    for chunk in step.chunks:
        scheduler.complete(chunk, 7 if chunk.end >= len(chunk.request.prompt) else None)
        request = chunk.request
        if len(request.output) >= max_tokens and request in scheduler.running:
            scheduler.finish(request)


def test_decodes_first_then_chunked_prefill_within_the_budget():
    _, _, scheduler = make(budget=10)
    short, long = Request(list(range(5))), Request(list(range(100, 130)))
    scheduler.add(short)
    scheduler.add(long)
    first = scheduler.schedule()
    assert first.num_tokens <= 10 and [c.request for c in first.prefills] == [short, long]
    run_step(scheduler, first)
    second = scheduler.schedule()
    assert [c.request for c in second.decodes] == [short]  # short decodes while long still prefills
    assert second.prefills[0].request is long and second.prefills[0].start == 5
    assert second.num_tokens <= 10


def test_a_short_prefill_goes_before_a_long_one_already_running():
    """Shortest remaining prefill first: a newcomer with 4 tokens to compute is not held behind
    a running prompt that still needs more than the whole budget."""
    _, _, scheduler = make(budget=10)
    long = Request(list(range(100, 140)))
    scheduler.add(long)
    run_step(scheduler, scheduler.schedule())
    short = Request(list(range(4)))
    scheduler.add(short)
    step = scheduler.schedule()
    assert [(c.request, c.start, c.end) for c in step.prefills] == [(short, 0, 4), (long, 10, 16)]


def test_a_long_prefill_passed_over_too_often_goes_first():
    from kvwise.engine.scheduler import STARVATION_STEPS

    _, _, scheduler = make(budget=8)
    long = Request(list(range(100, 140)))
    scheduler.add(long)
    run_step(scheduler, scheduler.schedule())  # long computes 8 tokens, then short ones keep coming
    skipped = 0
    for index in range(STARVATION_STEPS + 1):
        scheduler.add(Request(list(range(200 + 10 * index, 208 + 10 * index)), SamplingParams(max_tokens=1)))
        step = scheduler.schedule()
        if step.prefills[0].request is long:
            break
        skipped += 1
        run_step(scheduler, step, max_tokens=1)
    assert skipped == STARVATION_STEPS and long.computed == 8


def test_cache_aware_order_then_fcfs_under_a_long_queue():
    _, tree, scheduler = make(budget=64, fcfs_queue_length=2)
    warm = Request(list(range(20)))
    scheduler.add(warm)
    while not warm.done:
        run_step(scheduler, scheduler.schedule())
    cold, hot = Request(list(range(500, 520))), Request(list(range(20)) + [9])
    scheduler.add(cold)
    scheduler.add(hot)
    step = scheduler.schedule()
    assert step.prefills[0].request is hot and hot.reused == 20  # the cached prefix first, and reused
    _, _, fcfs = make(budget=8, fcfs_queue_length=0)
    first, second = Request(list(range(600, 608))), Request(list(range(20)))
    fcfs.add(first)
    fcfs.add(second)
    assert fcfs.schedule().prefills[0].request is first


def test_memory_pressure_preempts_the_newest_and_requeues_it():
    pool, _, scheduler = make(num_blocks=6, budget=32)
    older, newer = Request(list(range(12))), Request(list(range(50, 62)))
    scheduler.add(older)
    scheduler.add(newer)
    run_step(scheduler, scheduler.schedule(), max_tokens=99)  # both prefilled: 3 + 3 blocks, pool full
    step = scheduler.schedule()  # older needs a 4th block for its 13th token
    assert step.preempted == [newer] and newer.status is Status.WAITING and scheduler.waiting[0] is newer
    assert [c.request for c in step.decodes] == [older] and len(newer.blocks) == 0
    assert pool.stats().free + pool.stats().used == pool.stats().total


def test_no_leak_after_many_requests_with_cancellations():
    pool, tree, scheduler = make(num_blocks=40, budget=24)
    requests = [Request(list(range(i % 5, i % 5 + 12 + i % 7)), SamplingParams()) for i in range(60)]
    for index, request in enumerate(requests):
        scheduler.add(request)
        step = scheduler.schedule()
        run_step(scheduler, step)
        if index % 7 == 0:
            scheduler.cancel(request)
    while scheduler.running or scheduler.waiting:
        run_step(scheduler, scheduler.schedule())
    assert all(r.done for r in requests)
    held = {node.block for node in tree.nodes()}
    for block, refs in enumerate(pool.ref_counts):
        assert refs == (1 if block in held else 0)  # free, or held only by the prefix cache
    assert all(node.locks == 0 for node in tree.nodes())


def test_requests_stuck_mid_prefill_make_progress():
    """Both running requests are prefilling and neither can get the blocks for its next chunk:
    the chunk shrinks to what is free, and when nothing is free the newest gives its blocks back."""
    pool, _, scheduler = make(num_blocks=7, budget=32)
    first, second = Request(list(range(20)), SamplingParams(max_tokens=2)), Request(list(range(100, 120)))
    for request in (first, second):
        request.status = Status.RUNNING
        request.blocks, request.computed, request.reserved = BlockTable(pool.allocate(3)), 12, True
        scheduler.running.append(request)
    step = scheduler.schedule()  # one block free: first gets a 4-token chunk, second nothing
    assert [(c.request, c.start, c.end) for c in step.prefills] == [(first, 12, 16)]
    run_step(scheduler, step)
    step = scheduler.schedule()  # nothing free: second is preempted, first finishes its prompt
    assert step.preempted == [second] and [(c.request, c.end) for c in step.prefills] == [(first, 20)]


def test_a_newcomer_locking_the_only_evictable_prefix_does_not_stall_a_running_prefill():
    """The newcomer is admitted first (its cached prefix locked) but gets no memory; once it is
    sent back, the running prompt must still get the blocks that prefix held."""
    pool, tree, scheduler = make(num_blocks=8, budget=16)
    cached = Request(list(range(16)), SamplingParams(max_tokens=1))
    scheduler.add(cached)
    while not cached.done:
        run_step(scheduler, scheduler.schedule(), max_tokens=1)
    running = Request(list(range(100, 140)), SamplingParams(max_tokens=1))
    scheduler.add(running)
    run_step(scheduler, scheduler.schedule(), max_tokens=1)
    assert running.computed == 16 and pool.num_free == 0  # the tree holds the other 4 blocks
    scheduler.add(Request(list(range(16)) + [7, 7, 7, 7], SamplingParams(max_tokens=1)))
    step = scheduler.schedule()
    assert [(c.request, c.start) for c in step.prefills] == [(running, 16)] and not step.preempted


def test_running_slots_go_round_the_tenants():
    """A tenant that queued a burst first does not take every running slot: the next slot goes
    to the tenant running the fewest, so the other tenant runs its fair half at once."""
    _, _, scheduler = make(budget=256, max_running=4)
    burst = [Request(list(range(100 * i, 100 * i + 8)), tenant="alice") for i in range(1, 9)]
    others = [Request(list(range(5000 + 100 * i, 5000 + 100 * i + 8)), tenant="bob") for i in range(2)]
    for request in burst + others:
        scheduler.add(request)
    scheduler.schedule()
    running = [request.tenant for request in scheduler.running]
    assert running.count("bob") == 2 and running.count("alice") == 2
    assert [request for request in burst if request.status is Status.RUNNING] == burst[:2]  # alice's in order
