"""`kvwise bench cluster`: the RAG workload on N engine replicas on a local Ray Serve, with and
without the shared Redis (Cluster) tier, under kvwise's router, Ray's power of two choices and a
text prefix tree (the stand-in for Ray Serve LLM's PrefixCacheAffinityRouter, which needs
`ray[llm]`), against one replica, in one run.

Every system gets the same requests in the same order from the same closed loop of streaming
clients, and a fresh namespace key, so nothing one system cached is a hit for the next. Each
request's hit tokens come from its `usage.prompt_tokens_details.cached_tokens`; where they came
from (device, host, Redis) from the replicas' metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from tqdm import tqdm

from kvwise.bench.loopback_server import LoopbackServer
from kvwise.bench.rag_workload import RagWorkload, rag_prompts
from kvwise.bench.report_files import model_label, new_report, system_line, write_report
from kvwise.bench.stats import percentile
from kvwise.util.plotting import headless_pyplot

SYSTEMS = ("single", "kvwise+redis", "kvwise", "pow2+redis", "pow2", "text-prefix+redis", "text-prefix")


@dataclass
class ClusterConfig(RagWorkload):
    requests: int = 64
    documents: int = 8
    system_prompt_tokens: int = 300
    document_tokens: tuple[int, int] = (1000, 2000)
    question_tokens: tuple[int, int] = (20, 60)
    output_tokens: int = 16
    model: str | None = None
    replicas: int = 2
    concurrency: int = 4
    redis_url: str | None = None  # redis:// or redis+cluster://; without it, the +redis systems are left out
    systems: tuple[str, ...] = SYSTEMS
    stats_period: float = 0.5  # seconds between replicas' routing reports
    # each replica's KV pool holds this share of the workload's distinct prefixes (the system
    # prompt and the documents), besides room for the requests running: one replica cannot keep
    # every document, two can if each keeps its own. The single replica gets the same pool.
    cache_share: float = 0.5
    pool_blocks: int | None = None  # set from cache_share for the run

    def __post_init__(self):
        super().__post_init__()
        unknown = [system for system in self.systems if system.split("+")[0] not in ("single", *ROUTER_NAMES)]
        if unknown:
            raise ValueError(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
        if not 0 < self.cache_share <= 1:
            raise ValueError(f"--cache-share must be in (0, 1], got {self.cache_share}")
        if self.replicas < 2:
            raise ValueError(
                f"bench cluster compares routers over replicas: --replicas must be >= 2, got {self.replicas}"
            )


ROUTER_NAMES = ("kvwise", "pow2", "text-prefix")


def run_cluster_bench(config: ClusterConfig, out_dir: Path) -> dict:
    import ray

    from kvwise.models import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    parts = rag_prompts(tokenizer, config)
    prompts = [tokenizer.decode(ids) for ids, _ in parts]
    config.pool_blocks = pool_blocks(config, parts)
    systems = [s for s in config.systems if "+redis" not in s or config.redis_url]
    skipped = [s for s in config.systems if s not in systems]
    if skipped:
        print(f"bench cluster: no --redis-url, leaving out {', '.join(skipped)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=max(2, config.replicas), include_dashboard=False, object_store_memory=256 << 20)
    results = []
    try:
        with tqdm(total=len(prompts) * len(systems), desc="cluster", unit="request") as progress:
            for system in systems:
                results.append(_run_system(system, config, prompts, progress))
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    report = new_report("cluster", config, torch.device("cpu"), summary=summarize(results), results=results)
    return write_report(out_dir, report, markdown, {"cluster.png": plot})


def pool_blocks(config: ClusterConfig, parts: list[tuple[list[int], int]], block_size: int = 16) -> int:
    """Blocks for `cache_share` of the distinct prefixes, plus the longest prompts running at once."""
    prefixes = {tuple(ids[:end]) for ids, end in parts}
    documents = {prefix[config.system_prompt_tokens :] for prefix in prefixes}
    distinct = config.system_prompt_tokens + sum(map(len, documents))
    running = sorted((len(ids) + config.output_tokens for ids, _ in parts), reverse=True)[: config.concurrency]
    return int(config.cache_share * distinct / block_size) + sum(-(-tokens // block_size) for tokens in running)


def _run_system(system: str, config: ClusterConfig, prompts: list[str], progress) -> dict:
    from kvwise.cluster.launch import deploy
    from kvwise.server.serve import add_serve_arguments

    router, _, tier = system.partition("+")
    replicas = 1 if router == "single" else config.replicas
    with tempfile.TemporaryDirectory() as folder:
        key_file = Path(folder) / "namespace"
        key_file.write_text(secrets.token_hex(32))  # a cold cache: no system reuses another's blocks
        flags = ["--namespace-key-file", str(key_file), "--log-stats-interval", "0", "--log-level", "warning"]
        flags += ["--num-blocks", str(config.pool_blocks), "--swap-space-gb", "1"]
        if config.model:
            flags += ["--model", config.model]
        key_prefix = f"kvwise-bench:{secrets.token_hex(4)}:"
        if tier:
            (Path(folder) / "redis-hmac").write_text(secrets.token_hex(32))
            flags += ["--redis-url", config.redis_url, "--redis-hmac-key-file", str(Path(folder) / "redis-hmac")]
            flags += ["--redis-key-prefix", key_prefix]
        parser = argparse.ArgumentParser(prog="kvwise serve")
        add_serve_arguments(parser)  # the flags `kvwise serve` takes, without the CLI above the bench
        args = parser.parse_args(flags)
        args.replicas = replicas
        cluster = deploy(
            args, replicas, router="kvwise" if router == "single" else router, stats_period=config.stats_period
        )
        try:
            with LoopbackServer(cluster.app) as server:
                started = time.perf_counter()
                answers = asyncio.run(_closed_loop(server.base_url, config, prompts, progress, args))
                wall = time.perf_counter() - started
                metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
            counters = cluster.ingress.counters
        finally:
            cluster.shutdown()
            if tier:
                delete_keys(config.redis_url, key_prefix)
    return _row(system, replicas, answers, wall, metrics, counters)


def delete_keys(url: str, prefix: str) -> int:
    """Delete what one system wrote to Redis (its keys start with `prefix`), on every node."""
    from kvwise.tiers.redis_tier import RedisTier

    client = RedisTier(url, hmac_key=b"unused").client
    nodes = client.get_primaries() if hasattr(client, "get_primaries") else [None]
    deleted = 0
    for node in nodes:
        scan = client.scan_iter(match=f"{prefix}*", count=1000, **({"target_nodes": node} if node else {}))
        for key in scan:
            deleted += client.delete(key)
    return deleted


async def _closed_loop(base_url: str, config: ClusterConfig, prompts: list[str], progress, args) -> list[dict]:
    from kvwise.server.serve import served_name

    queue: asyncio.Queue = asyncio.Queue()
    for index, prompt in enumerate(prompts):
        queue.put_nowait((index, prompt))
    answers: list[dict | None] = [None] * len(prompts)
    model = served_name(args)

    async def client() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
            while not queue.empty():
                index, prompt = queue.get_nowait()
                answers[index] = await _one(http, model, prompt, config.output_tokens)
                progress.update(1)

    await asyncio.gather(*(client() for _ in range(config.concurrency)))
    return answers


async def _one(http, model: str, prompt: str, output_tokens: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started, first, usage = time.perf_counter(), None, None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the cluster answered {response.status_code}: {(await response.aread())[:300]!r}")
        replica = response.headers.get("x-kvwise-replica")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"a stream failed: {event['error']}")
            if event.get("choices") and first is None:
                first = time.perf_counter()
            if event.get("usage"):
                usage = event["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "replica": replica,
        "ttft_s": first - started,
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "cached_tokens": cached,
    }


def _metric_sum(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _row(system: str, replicas: int, answers: list[dict], wall: float, metrics: str, counters) -> dict:
    prompt_tokens = sum(answer["prompt_tokens"] for answer in answers)
    cached = sum(answer["cached_tokens"] for answer in answers)
    host = _metric_sum(metrics, "kvwise_prefix_cache_tier_hits_tokens_total", 'tier="host"')
    redis = _metric_sum(metrics, "kvwise_prefix_cache_tier_hits_tokens_total", 'tier="redis"')
    ttft = [answer["ttft_s"] for answer in answers]
    served = Counter(answer["replica"] for answer in answers)
    return {
        "system": system,
        "replicas": replicas,
        "requests": len(answers),
        "hit_rate": cached / prompt_tokens,
        "hit_rate_by_tier": {
            "device": max(0.0, cached - host - redis) / prompt_tokens,
            "host": host / prompt_tokens,
            "redis": redis / prompt_tokens,
        },
        "redis_share_of_hits": redis / cached if cached else 0.0,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "output_tokens_per_second": sum(answer["completion_tokens"] for answer in answers) / wall,
        "wall_s": wall,
        "replica_shares": sorted((count / len(answers) for count in served.values()), reverse=True),
        "rerouted": counters.rerouted,
        "published_blocks": _metric_sum(metrics, "kvwise_prefix_published_blocks_total"),
    }


def summarize(results: list[dict]) -> dict:
    rows = {row["system"]: row for row in results}
    summary = {}
    single = rows.get("single")
    ours = rows.get("kvwise+redis")
    if single and ours:
        summary["kvwise_redis_hit_rate_vs_single"] = ours["hit_rate"] / single["hit_rate"] if single["hit_rate"] else 0
        summary["kvwise_redis_replica_shares"] = ours["replica_shares"]
    if ours and "pow2" in rows:
        summary["kvwise_redis_ttft_p50_speedup_vs_pow2"] = rows["pow2"]["ttft_p50_s"] / ours["ttft_p50_s"]
    if ours and "text-prefix+redis" in rows:
        summary["kvwise_redis_hit_rate_minus_text_prefix_redis"] = (
            ours["hit_rate"] - rows["text-prefix+redis"]["hit_rate"]
        )
    if ours and "text-prefix" in rows:
        summary["kvwise_redis_hit_rate_minus_text_prefix"] = ours["hit_rate"] - rows["text-prefix"]["hit_rate"]
    if single and "pow2+redis" in rows and single["hit_rate"]:
        summary["pow2_redis_hit_rate_vs_single"] = rows["pow2+redis"]["hit_rate"] / single["hit_rate"]
    return summary


def markdown(report: dict) -> str:
    config, summary = report["config"], report["summary"]
    lines = [
        f"Cluster RAG serving: {config['requests']} requests, {config['documents']} documents (Zipf "
        f"{config['zipf_exponent']}), {config['concurrency']} streaming clients in a closed loop, "
        f"{config['output_tokens']} output tokens each, {config['replicas']} replicas on a local Ray Serve, "
        f"model={model_label(config)}, shared tier {config['redis_url'] or 'none'}, "
        f"a pool of {config['pool_blocks']:,} blocks per replica ({config['cache_share']:.0%} of the distinct "
        "prefixes, plus the running requests)",
        system_line(report["system"]),
        "",
        "| system | replicas | hit rate | device / host / Redis | TTFT p50 / p99 (s) | output tok/s | "
        "requests per replica | re-routed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        tiers = row["hit_rate_by_tier"]
        shares = " / ".join(f"{share:.0%}" for share in row["replica_shares"])
        lines.append(
            f"| {row['system']} | {row['replicas']} | {row['hit_rate']:.3f} | "
            f"{tiers['device']:.3f} / {tiers['host']:.3f} / {tiers['redis']:.3f} | "
            f"{row['ttft_p50_s']:.3f} / {row['ttft_p99_s']:.3f} | {row['output_tokens_per_second']:.2f} | "
            f"{shares} | {row['rerouted']} |"
        )
    lines += [
        "",
        "text-prefix: a text prefix tree following PrefixCacheAffinityRouter's documented policy "
        "(Ray's own needs ray[llm]).",
    ]
    names = {
        "kvwise_redis_hit_rate_vs_single": "kvwise+redis hit rate / single replica's",
        "kvwise_redis_ttft_p50_speedup_vs_pow2": "TTFT p50: pow2 (no shared tier) / kvwise+redis",
        "kvwise_redis_hit_rate_minus_text_prefix_redis": "hit rate: kvwise+redis - text-prefix+redis",
        "kvwise_redis_hit_rate_minus_text_prefix": "hit rate: kvwise+redis - text-prefix",
        "pow2_redis_hit_rate_vs_single": "pow2+redis hit rate / single replica's",
    }
    for key, label in names.items():
        if key in summary:
            lines.append(f"- {label}: {summary[key]:.3f}")
    if "kvwise_redis_replica_shares" in summary:
        lines.append(f"- kvwise+redis requests per replica: {summary['kvwise_redis_replica_shares']}")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    plt = headless_pyplot("cluster plot")
    if plt is None:
        return
    rows = report["results"]
    names = [row["system"] for row in rows]
    figure, (hits, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    bottom = [0.0] * len(rows)
    for tier, color in (("device", "#4c72b0"), ("host", "#55a868"), ("redis", "#c44e52")):
        values = [row["hit_rate_by_tier"][tier] for row in rows]
        hits.bar(names, values, bottom=bottom, label=tier, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    hits.set_ylabel("hit rate (prompt tokens)")
    hits.legend()
    ttft.bar(names, [row["ttft_p50_s"] for row in rows], color="#8172b2")
    ttft.set_ylabel("TTFT p50 (s)")
    for axis in (hits, ttft):
        axis.tick_params(axis="x", rotation=35)
    figure.suptitle("bench cluster: RAG on replicas by router and shared tier")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
