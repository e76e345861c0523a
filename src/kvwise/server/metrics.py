"""`ServerMetrics`: what `/metrics` exposes, in the Prometheus text format.

Counters and histograms are updated by the engine thread as requests are admitted, produce
tokens and finish; gauges of state (pool, queue, tree) are read when Prometheus scrapes.
Prefix-cache queries and hits are labelled by tenant only when asked (`--metrics-per-tenant`).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvwise.engine.core import EngineCore, TokenEvent
from kvwise.engine.request import Request

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)


OTHER_TENANTS = "other"
ALL_TENANTS = "all"


class ServerMetrics:
    """per_tenant: label prefix-cache counters by tenant (off by default: a scrape would show each
    tenant's prompt and hit volumes); at most `max_tenants` tenants get a label of their own, the
    rest count as "other", so the label set stays bounded whatever names clients bring."""

    def __init__(self, core: EngineCore, per_tenant: bool = False, max_tenants: int = 32):
        self.per_tenant, self.max_tenants = per_tenant, max_tenants
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
        self.ttft = Histogram(
            "kvwise_time_to_first_token_seconds",
            "Arrival to first output token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "kvwise_time_per_output_token_seconds",
            "Mean time between output tokens, per finished request",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.requests = Counter("kvwise_requests", "Requests by outcome", ["outcome"], registry=registry)
        self.rejected = self.requests.labels("rejected_queue_full")
        self.prompt_tokens = Counter("kvwise_prompt_tokens", "Prompt tokens admitted", registry=registry)
        self.generated_tokens = Counter("kvwise_generation_tokens", "Tokens generated", registry=registry)
        self._counted: set[str] = set()  # request ids whose prefix lookup is counted (once, not per preemption)
        registry.register(_StateCollector(core))
        core.scheduler.on_admit.append(self.on_admit)

    def on_admit(self, request: Request) -> None:
        """Count a request's prefix lookup once, at its first admission (not again after a preemption)."""
        if request.request_id not in self._counted:
            self._counted.add(request.request_id)
            tenant = self.tenant_label(request.tenant)
            self.queries.labels(tenant).inc(len(request.prompt))
            self.hits.labels(tenant).inc(request.reused)
            self.prompt_tokens.inc(len(request.prompt))

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
            return
        self.generated_tokens.inc()
        if len(request.output) == 1 and request.first_token_time is not None:
            self.ttft.observe(request.first_token_time - request.arrival)
        if event.finish_reason is not None:
            self.requests.labels(f"finished_{event.finish_reason}").inc()
            if len(request.output) > 1:
                self.tpot.observe((request.finish_time - request.first_token_time) / (len(request.output) - 1))
            self._counted.discard(request.request_id)

    def on_cancelled(self, request: Request) -> None:
        self.requests.labels("cancelled").inc()
        self._counted.discard(request.request_id)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    """Gauges read from the engine at scrape time (reads of ints; safe from another thread)."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.block_bytes = core.storage.nbytes() // core.pool.num_blocks

    def collect(self):
        core, stats = self.core, self.core.pool.stats()
        cached = len(core.tree) if core.tree is not None else 0
        usage = GaugeMetricFamily("kvwise_kv_usage_bytes", "KV bytes in use, per tier", labels=["tier"])
        usage.add_metric(["device"], stats.used * self.block_bytes)
        capacity = GaugeMetricFamily("kvwise_kv_capacity_bytes", "KV bytes available, per tier", labels=["tier"])
        capacity.add_metric(["device"], stats.total * self.block_bytes)
        swap, evicted = core.swap, core.tree.evictions if core.tree is not None else 0
        spilled = swap.swapped_out_blocks if swap is not None else 0
        if swap is not None:
            usage.add_metric(["host"], swap.used_bytes)
            capacity.add_metric(["host"], swap.capacity_bytes)
        tiers = core.prefix_tiers.tiers if core.prefix_tiers is not None else []
        for tier in tiers:  # where evicted prefix blocks went
            usage.add_metric([f"prefix_{tier.name}"], tier.stats.bytes_held)
            if getattr(tier, "capacity_bytes", None) is not None:
                capacity.add_metric([f"prefix_{tier.name}"], tier.capacity_bytes)
        quantized = sum(pool.used_bytes() for pool in list(core.quant_pools.values()))
        usage.add_metric(["device_quantized"], quantized)
        yield usage
        yield capacity
        error = GaugeMetricFamily(
            "kvwise_quantization_relative_error",
            "Mean relative reconstruction error of the blocks stored quantized, per quantizer",
            labels=["quantizer", "part"],
        )
        for name, pool in list(core.quant_pools.items()):
            error.add_metric([name, "keys"], pool.mean_error("keys"))
            error.add_metric([name, "values"], pool.mean_error("values"))
        yield error
        given_up = spilled + core.scheduler.recomputed_blocks + evicted
        kept = spilled + core.prefix_stats.spilled_blocks
        yield GaugeMetricFamily(
            "kvwise_spill_ratio",
            "Of the device blocks given up (preemption, prefix-cache eviction), the share kept on a lower tier",
            value=kept / given_up if given_up else 0.0,
        )
        tier_hits = CounterMetricFamily(
            "kvwise_prefix_cache_tier_hits_tokens",
            "Prompt tokens whose KV came back from a lower tier",
            labels=["tier"],
        )
        tier_errors = CounterMetricFamily(
            "kvwise_prefix_tier_errors", "Lower-tier failures (the block is recomputed)", labels=["tier", "kind"]
        )
        for tier in tiers:
            tier_hits.add_metric([tier.name], core.prefix_stats.hits_tokens[tier.name])
            tier_errors.add_metric([tier.name, "corrupt"], tier.stats.corrupt)
            tier_errors.add_metric([tier.name, "unavailable"], tier.stats.errors)
        yield tier_hits
        yield tier_errors
        swapped = CounterMetricFamily("kvwise_swapped_blocks", "Blocks copied between tiers", labels=["direction"])
        swapped.add_metric(["out"], spilled)
        swapped.add_metric(["in"], swap.swapped_in_blocks if swap is not None else 0)
        yield swapped
        blocks = GaugeMetricFamily("kvwise_kv_blocks", "Device KV blocks by state", labels=["state"])
        blocks.add_metric(["free"], stats.free)
        blocks.add_metric(["used"], stats.used)
        blocks.add_metric(["prefix_cached"], cached)
        yield blocks
        evictions = CounterMetricFamily("kvwise_prefix_cache_evictions_blocks", "Blocks evicted from the prefix cache")
        evictions.add_metric([], evicted)
        yield evictions
        preemptions = CounterMetricFamily("kvwise_preemptions", "Requests preempted under memory pressure")
        preemptions.add_metric([], core.scheduler.preemptions)
        yield preemptions
        yield GaugeMetricFamily("kvwise_queue_depth", "Requests waiting to run", value=len(core.scheduler.waiting))
        yield GaugeMetricFamily("kvwise_running_requests", "Requests running", value=len(core.scheduler.running))
        yield GaugeMetricFamily(
            "kvwise_uptime_seconds", "Seconds since the metrics started", value=time.monotonic() - _START
        )


_START = time.monotonic()
