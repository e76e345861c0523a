"""`ServerMetrics`: what `/metrics` exposes, in the Prometheus text format.

Counters and histograms are updated by the engine thread as requests are admitted, produce
tokens and finish; gauges of state (pool, queue, tree) are read when Prometheus scrapes.
Prefix-cache queries and hits are labelled by tenant only when asked (`--metrics-per-tenant`).
Every series carries a `model_name` label (the served model's name), as vLLM's do, so one
Prometheus can scrape several servers. Each series is described in docs/configuration.md.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvwise.engine.core import EngineCore, TokenEvent
from kvwise.engine.kv_stats import KVStats
from kvwise.engine.request import Request

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)


OTHER_TENANTS = "other"
ALL_TENANTS = "all"


class ServerMetrics:
    """per_tenant: label prefix-cache counters by tenant (off by default: a scrape would show each
    tenant's prompt and hit volumes); at most `max_tenants` tenants get a label of their own, the
    rest count as "other", so the label set stays bounded whatever names clients bring."""

    def __init__(self, core: EngineCore, per_tenant: bool = False, max_tenants: int = 32, model_name: str = ""):
        self.per_tenant, self.max_tenants, self.model_name = per_tenant, max_tenants, model_name
        self._labelled: set[str] = set()
        disable_created_metrics()  # no `_created` twin for every counter: half the text, same information
        self.core = core
        self.registry = registry = CollectorRegistry()
        self.queries = Counter(
            "kvwise_prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache",
            ["tenant"],
            registry=registry,
        )
        self.hits = Counter(
            "kvwise_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache", ["tenant"], registry=registry
        )

        def latency(name: str, documentation: str) -> Histogram:
            return Histogram(name, documentation, buckets=LATENCY_BUCKETS, registry=registry)

        self.ttft = latency("kvwise_time_to_first_token_seconds", "Arrival to first output token")
        self.tpot = latency(
            "kvwise_time_per_output_token_seconds", "Mean time between output tokens, per finished request"
        )
        self.e2e = latency(
            "kvwise_e2e_request_latency_seconds", "Arrival to the last output token, per finished request"
        )
        self.queue_time = latency(
            "kvwise_request_queue_time_seconds", "Arrival to first admission (time spent waiting for a slot and memory)"
        )
        self.inter_token = latency(
            "kvwise_inter_token_latency_seconds", "Time between two consecutive output tokens of a request"
        )
        self._last_token: dict[str, float] = {}  # request id -> when its previous token came
        self.requests = Counter("kvwise_requests", "Requests by outcome", ["outcome"], registry=registry)
        self.rejected = self.requests.labels("rejected_queue_full")
        self.prompt_tokens = Counter("kvwise_prompt_tokens", "Prompt tokens admitted", registry=registry)
        self.generated_tokens = Counter("kvwise_generation_tokens", "Tokens generated", registry=registry)
        self._counted: set[str] = set()  # request ids whose prefix lookup is counted (once, not per preemption)
        # the same counts as plain totals, for the periodic stats line (`StatsLog`) to take differences of
        self.prompt_total = self.hit_total = self.generated_total = 0
        registry.register(_StateCollector(core))
        core.scheduler.on_admit.append(self.on_admit)

    def on_admit(self, request: Request) -> None:
        """Count a request's prefix lookup once, at its first admission (not again after a preemption)."""
        if request.request_id not in self._counted:
            self._counted.add(request.request_id)
            self.queue_time.observe(max(0.0, time.monotonic() - request.arrival))
            tenant = self.tenant_label(request.tenant)
            self.queries.labels(tenant).inc(len(request.prompt))
            self.hits.labels(tenant).inc(request.reused)
            self.prompt_tokens.inc(len(request.prompt))
            self.prompt_total += len(request.prompt)
            self.hit_total += request.reused

    def tenant_label(self, tenant: str) -> str:
        if not self.per_tenant:
            return ALL_TENANTS
        if tenant in self._labelled or len(self._labelled) < self.max_tenants:
            self._labelled.add(tenant)
            return tenant
        return OTHER_TENANTS

    def on_token(self, event: TokenEvent) -> None:
        request = event.request
        if event.finish_reason == "error":  # no token: the request failed (counted as failed on delivery)
            self._counted.discard(request.request_id)
            self._last_token.pop(request.request_id, None)
            return
        self.generated_tokens.inc()
        self.generated_total += 1
        now = time.monotonic()
        if len(request.output) == 1 and request.first_token_time is not None:
            self.ttft.observe(request.first_token_time - request.arrival)
        previous = self._last_token.get(request.request_id)
        if previous is not None:
            self.inter_token.observe(now - previous)
        self._last_token[request.request_id] = now
        if event.finish_reason is not None:
            self.requests.labels(f"finished_{event.finish_reason}").inc()
            if len(request.output) > 1:
                self.tpot.observe((request.finish_time - request.first_token_time) / (len(request.output) - 1))
            self.e2e.observe((request.finish_time or now) - request.arrival)
            self._counted.discard(request.request_id)
            self._last_token.pop(request.request_id, None)

    def on_cancelled(self, request: Request) -> None:
        self.requests.labels("cancelled").inc()
        self._counted.discard(request.request_id)
        self._last_token.pop(request.request_id, None)

    def render(self) -> bytes:
        return generate_latest(_ModelLabelled(self.registry, self.model_name))


class _ModelLabelled:
    """The registry's series, each with a `model_name` label added."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.registry, self.model_name = registry, model_name

    def collect(self):
        for family in self.registry.collect():
            family.samples = [
                sample._replace(labels={"model_name": self.model_name, **sample.labels}) for sample in family.samples
            ]
            yield family


class _StateCollector:
    """Gauges read at scrape time: KV memory from `KVCacheManager.stats()`, the queue from the
    scheduler (reads of ints; safe from another thread)."""

    def __init__(self, core: EngineCore):
        self.core = core

    def collect(self):
        kv, scheduler = self.core.kv.stats(), self.core.scheduler
        yield from _memory_metrics(kv)
        yield from _prefix_tier_metrics(kv)
        yield from _block_metrics(kv)
        preemptions = CounterMetricFamily("kvwise_preemptions", "Requests preempted under memory pressure")
        preemptions.add_metric([], scheduler.preemptions)
        yield preemptions
        if self.core.controller is not None:
            yield from adaptive_metrics(self.core.controller)
        yield GaugeMetricFamily("kvwise_queue_depth", "Requests waiting to run", value=len(scheduler.waiting))
        yield GaugeMetricFamily("kvwise_running_requests", "Requests running", value=len(scheduler.running))
        yield GaugeMetricFamily(
            "kvwise_uptime_seconds", "Seconds since the metrics started", value=time.monotonic() - _START
        )


def _memory_metrics(kv: KVStats):
    """KV bytes in use and available per tier, quantization error, spill ratio."""
    usage = GaugeMetricFamily("kvwise_kv_usage_bytes", "KV bytes in use, per tier", labels=["tier"])
    usage.add_metric(["device"], kv.used_bytes)
    capacity = GaugeMetricFamily("kvwise_kv_capacity_bytes", "KV bytes available, per tier", labels=["tier"])
    capacity.add_metric(["device"], kv.capacity_bytes)
    if kv.swap_used_bytes is not None:
        usage.add_metric(["host"], kv.swap_used_bytes)
        capacity.add_metric(["host"], kv.swap_capacity_bytes)
    for tier in kv.tiers:  # where evicted prefix blocks went
        usage.add_metric([f"prefix_{tier.name}"], tier.bytes_held)
        if tier.capacity_bytes is not None:
            capacity.add_metric([f"prefix_{tier.name}"], tier.capacity_bytes)
    usage.add_metric(["device_quantized"], kv.quantized_bytes)
    yield usage
    yield capacity
    error = GaugeMetricFamily(
        "kvwise_quantization_relative_error",
        "Mean relative reconstruction error of the blocks stored quantized, per quantizer",
        labels=["quantizer", "part"],
    )
    for name, (keys, values) in kv.quantization_errors.items():
        error.add_metric([name, "keys"], keys)
        error.add_metric([name, "values"], values)
    yield error
    yield GaugeMetricFamily(
        "kvwise_spill_ratio",
        "Of the device blocks given up (preemption, prefix-cache eviction), the share kept on a lower tier",
        value=kv.spill_ratio,
    )


def _prefix_tier_metrics(kv: KVStats):
    """Per lower tier of the prefix cache: tokens restored, failures, whether it answers, publishing."""
    tier_hits = CounterMetricFamily(
        "kvwise_prefix_cache_tier_hits_tokens",
        "Prompt tokens whose KV came back from a lower tier",
        labels=["tier"],
    )
    tier_errors = CounterMetricFamily(
        "kvwise_prefix_tier_errors", "Lower-tier failures (the block is recomputed)", labels=["tier", "kind"]
    )
    tier_up = GaugeMetricFamily(
        "kvwise_prefix_tier_up",
        "1 while a lower tier answers, 0 while it is down (misses recompute)",
        labels=["tier"],
    )
    published = CounterMetricFamily(
        "kvwise_prefix_published_blocks",
        "Computed prefix blocks written to a shared tier at once, for other servers",
        labels=["tier"],
    )
    for tier in kv.tiers:
        tier_hits.add_metric([tier.name], tier.hits_tokens)
        tier_errors.add_metric([tier.name, "corrupt"], tier.corrupt)
        tier_errors.add_metric([tier.name, "unavailable"], tier.errors)
        tier_up.add_metric([tier.name], float(tier.available))
        published.add_metric([tier.name], tier.published_blocks)
    yield tier_hits
    yield tier_errors
    yield tier_up
    yield published


def _block_metrics(kv: KVStats):
    """Blocks swapped between tiers, device blocks by state, the pool's usage, prefix evictions."""
    swapped = CounterMetricFamily("kvwise_swapped_blocks", "Blocks copied between tiers", labels=["direction"])
    swapped.add_metric(["out"], kv.swapped_out_blocks)
    swapped.add_metric(["in"], kv.swapped_in_blocks)
    yield swapped
    blocks = GaugeMetricFamily("kvwise_kv_blocks", "Device KV blocks by state", labels=["state"])
    blocks.add_metric(["free"], kv.free_blocks)
    blocks.add_metric(["used"], kv.used_blocks)
    blocks.add_metric(["prefix_cached"], kv.prefix_cached_blocks)
    yield blocks
    yield GaugeMetricFamily(
        "kvwise_kv_cache_usage_ratio",
        "Share of the device KV pool's blocks in use (prefix-cached blocks count as used)",
        value=kv.block_usage,
    )
    evictions = CounterMetricFamily("kvwise_prefix_cache_evictions_blocks", "Blocks evicted from the prefix cache")
    evictions.add_metric([], kv.prefix_evictions)
    yield evictions


def adaptive_metrics(controller):
    """The adaptive controller's decisions: actions by reason, bytes freed, predicted quality."""
    decisions = controller.decisions
    actions = CounterMetricFamily(
        "kvwise_adaptive_actions", "KV controller decisions by action and reason", labels=["action", "reason"]
    )
    for (action, reason), count in list(decisions.counts.items()):
        actions.add_metric([action, reason], count)
    yield actions
    freed = CounterMetricFamily(
        "kvwise_adaptive_freed_bytes", "KV bytes freed by controller actions", labels=["action"]
    )
    for action, count in list(decisions.bytes_freed.items()):
        freed.add_metric([action], count)
    yield freed
    quality = GaugeMetricFamily(
        "kvwise_adaptive_predicted_quality",
        "Mean predicted quality (vs the full cache) of the mixes chosen, per request class",
        labels=["class"],
    )
    for klass, value in decisions.predicted_quality().items():
        quality.add_metric([klass], value)
    yield quality
    yield GaugeMetricFamily("kvwise_adaptive_level", "Rungs of the pressure ladder in force", value=controller.level)


_START = time.monotonic()
