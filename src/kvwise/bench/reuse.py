"""`kvwise bench reuse`: what prefix reuse costs and saves.

Three measurements, all in one run (../docs BENCHMARKS "rag" for the third):
- lookup_us_per_token: `RadixCache.match_prefix` on a tree of `tree_blocks` blocks, per matched token;
- restore_speedup: restoring a `restore_tokens` prefix from host RAM, disk and Redis into a
  transformers cache, against recomputing its prefill;
- rag: requests made of a shared system prompt (70% of them), a Zipf-popular document and a
  question; prefill TTFT p50/p99 with reuse off and on, the token hit rate, and the achieved
  speedup next to the bound 1/(1 - hit_rate).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvwise.bench.haystack import read_haystack
from kvwise.bench.rag_workload import RagWorkload, rag_requests
from kvwise.bench.report_files import model_label, new_report, system_line, write_report
from kvwise.bench.stats import percentile
from kvwise.core.block_pool import BlockPool
from kvwise.core.hashing import Namespace, chain_keys
from kvwise.core.radix import RadixCache
from kvwise.hf.prefix_reuse import PrefixReuse
from kvwise.tiers.disk import DiskTier
from kvwise.tiers.host import HostTier
from kvwise.tiers.redis_tier import RedisTier


@dataclass
class ReuseConfig(RagWorkload):
    model: str | None = None
    dtype: str = "bfloat16"
    block_size: int = 16
    tree_blocks: int = 100_000
    restore_tokens: int = 2000
    redis_url: str | None = None  # a Redis to restore from; None: the Redis row is left out

    def __post_init__(self):
        super().__post_init__()
        if self.tree_blocks < 1 or self.restore_tokens < self.block_size:
            raise ValueError("need tree_blocks >= 1 and restore_tokens >= block_size")


def measure_lookup(tree_blocks: int, block_size: int, seed: int) -> float:
    """Microseconds per matched token of match_prefix on a tree holding `tree_blocks` blocks."""
    rng = random.Random(seed)
    pool = BlockPool(tree_blocks, block_size)
    tree = RadixCache(pool)
    namespace = Namespace("lookup-bench", "tenant")
    blocks_per_sequence = 128
    sequences = []
    for _ in range(tree_blocks // blocks_per_sequence):
        tokens = [rng.randrange(50_000) for _ in range(blocks_per_sequence * block_size)]
        blocks = pool.allocate(blocks_per_sequence)
        tree.insert(tokens, blocks, namespace)
        pool.release(blocks)
        sequences.append(tokens)
    probes = [rng.choice(sequences) for _ in range(200)]
    started = time.perf_counter()
    matched = sum(tree.match_prefix(tokens, namespace).length for tokens in probes)
    return (time.perf_counter() - started) * 1e6 / max(matched, 1)


def _prefill_seconds(model, ids: torch.Tensor) -> float:
    started = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, use_cache=True)
    return time.perf_counter() - started


def measure_restore(model, ids: torch.Tensor, block_size: int, tiers: dict, repeats: int = 5) -> dict:
    """Restoring ids' prefix from each tier on its own, fastest of `repeats`: into the device pool
    as the engine does (`pool_seconds`), and into a transformers cache (`library_seconds`, the
    pool then a DynamicCache); against recomputing its prefill, a plain copy of the same bytes
    (`copy_seconds`) and a raw read of the tier's entries (`raw_read_seconds`: the files, or one
    pipelined GET of the Redis values)."""
    recompute = min(_prefill_seconds(model, ids[:, :-1]) for _ in range(2))
    rows = {}
    for name, tier in tiers.items():
        blocks = ids.shape[1] // block_size + 2
        reuse = PrefixReuse(model, tenant="restore", block_size=block_size, device_blocks=blocks, tiers=[tier])
        reuse.generate(ids, max_new_tokens=1, do_sample=False)
        tokens = ids[0].tolist()
        usable = (len(tokens) - 1) // block_size
        library, pool = [], []
        for _ in range(repeats):
            reuse.tree.clear()  # the device pool is empty: everything must come from the tier
            started = time.perf_counter()
            _, restored = reuse.prefill_cache(ids)
            library.append(time.perf_counter() - started)
            if restored < usable * block_size:
                raise RuntimeError(f"the {name} tier restored only {restored} tokens")
            reuse.tree.clear()
            empty = reuse.tree.match_prefix(tokens[: usable * block_size], reuse.namespace)
            started = time.perf_counter()
            promoted = reuse.tiered.extend(tokens, reuse.namespace, empty, usable)
            pool.append(time.perf_counter() - started)
            if len(promoted) < usable:
                raise RuntimeError(f"the {name} tier restored only {len(promoted)} blocks into the pool")
        keys = chain_keys(tokens[: usable * block_size], block_size, reuse.namespace)
        nbytes = usable * reuse.storage.block_bytes
        rows[name] = {
            "bytes": nbytes,
            "recompute_seconds": recompute,
            "library_seconds": min(library),
            "pool_seconds": min(pool),
            "copy_seconds": plain_copy_seconds(nbytes, repeats),
            "raw_read_seconds": raw_read_seconds(tier, keys, repeats),
        }
    return rows


def plain_copy_seconds(nbytes: int, repeats: int, device: torch.device | str = "cpu") -> float:
    """The fastest of `repeats` `copy_`s of `nbytes` between two tensors allocated (and touched)
    beforehand on `device` (a first copy, untimed, warms them)."""
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    timings = []
    for _ in range(repeats + 1):
        synchronize(source.device)
        started = time.perf_counter()
        target.copy_(source)
        synchronize(source.device)
        timings.append(time.perf_counter() - started)
    return min(timings[1:])


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock timing covers it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def raw_read_seconds(tier, keys: list[bytes], repeats: int) -> float | None:
    """Reading the tier's entries for `keys` as bytes and nothing else: every file (page cache
    warm), or one pipelined GET of every Redis value; None for the host tier (its reference is
    the plain copy)."""
    if isinstance(tier, DiskTier):
        paths = [tier.path(key) for key in keys]

        def read() -> None:
            for path in paths:
                path.read_bytes()

    elif isinstance(tier, RedisTier):
        names = [tier.entry_name(key) for key in keys]

        def read() -> None:
            pipeline = tier.client.pipeline(transaction=False)
            for name in names:
                pipeline.get(name)
            pipeline.execute()

    else:
        return None
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        read()
        timings.append(time.perf_counter() - started)
    return min(timings)


def run_rag(model, requests: list[torch.Tensor], config: ReuseConfig, progress) -> dict:
    """TTFT with reuse off and on, over the same requests in the same order."""
    blocks_needed = sum(ids.shape[1] for ids in requests) // config.block_size + len(requests)
    reuse = PrefixReuse(model, tenant="rag", block_size=config.block_size, device_blocks=blocks_needed)
    ttft_off, ttft_on = [], []
    for ids in requests:
        ttft_off.append(_prefill_seconds(model, ids))
        progress.update()
    for ids in requests:
        started = time.perf_counter()
        cache, _ = reuse.prefill_cache(ids)
        with torch.no_grad():
            model(input_ids=ids[:, cache.get_seq_length() :], cache=cache, use_cache=True)
        ttft_on.append(time.perf_counter() - started)
        reuse.store(ids, cache)
        progress.update()
    prompt_tokens = sum(ids.shape[1] for ids in requests)
    hit_rate = sum(reuse.stats.hits_tokens.values()) / prompt_tokens
    p50_off, p50_on = statistics.median(ttft_off), statistics.median(ttft_on)
    return {
        "requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "hit_rate": hit_rate,
        "ttft_p50_s_off": p50_off,
        "ttft_p50_s_on": p50_on,
        "ttft_p99_s_off": percentile(ttft_off, 0.99),
        "ttft_p99_s_on": percentile(ttft_on, 0.99),
        "speedup": p50_off / p50_on,
        "bound": 1.0 / max(1.0 - hit_rate, 1e-9),
    }


def run_reuse(config: ReuseConfig, out_dir: Path) -> dict:
    from kvwise.models import load_model

    model, tokenizer = load_model(config.model, dtype=config.dtype)
    model.set_attn_implementation("sdpa")
    out_dir.mkdir(parents=True, exist_ok=True)
    lookup = measure_lookup(config.tree_blocks, config.block_size, config.seed)
    requests = rag_requests(tokenizer, config)
    restore_ids = tokenizer(read_haystack(), return_tensors="pt", add_special_tokens=False).input_ids
    restore_ids = restore_ids[:, -(config.restore_tokens + 1) :]
    with tempfile.TemporaryDirectory() as scratch, tqdm(total=2 * len(requests), desc="rag", unit="request") as bar:
        tiers = {
            "host": HostTier(capacity_bytes=8 << 30),
            "disk": DiskTier(Path(scratch) / "disk"),
            # a MAC key swaps the damage checksum for keyed BLAKE3: what authenticated files cost
            "disk (MAC key)": DiskTier(Path(scratch) / "disk-mac", mac_key=b"kvwise-bench"),
        }
        if config.redis_url is not None:
            tiers["redis"] = RedisTier(config.redis_url, hmac_key="kvwise-bench", ttl_seconds=600)
        else:
            print("no --redis-url: the Redis tier is left out (start a redis-server and pass its URL to time it)")
        restore = measure_restore(model, restore_ids, config.block_size, tiers)
        speedups = {name: row["recompute_seconds"] / row["library_seconds"] for name, row in restore.items()}
        rag = run_rag(model, requests, config, bar)
    fields = {"lookup_us_per_token": lookup, "restore_speedup": speedups, "restore": restore, "rag": rag}
    fields["results"] = []
    return write_report(out_dir, new_report("reuse", config, model.device, **fields), markdown)


def markdown(report: dict) -> str:
    config, rag = report["config"], report["rag"]
    lines = [
        f"Prefix reuse, model={model_label(config)} ({config['dtype']}), block size {config['block_size']}",
        system_line(report["system"]),
        "",
        f"- lookup: {report['lookup_us_per_token']:.3f} us per matched token "
        f"on a tree of {config['tree_blocks']:,} blocks",
        f"- restore a {config['restore_tokens']}-token prefix instead of recomputing it: "
        + ", ".join(f"{tier} {speedup:.1f}x" for tier, speedup in report["restore_speedup"].items()),
        *restore_lines(report.get("restore", {})),
        f"- RAG, {rag['requests']} requests ({rag['prompt_tokens']:,} prompt tokens): hit rate {rag['hit_rate']:.3f}",
        "",
        "| reuse | TTFT p50 (s) | TTFT p99 (s) |",
        "|---|---|---|",
        f"| off | {rag['ttft_p50_s_off']:.3f} | {rag['ttft_p99_s_off']:.3f} |",
        f"| on | {rag['ttft_p50_s_on']:.3f} | {rag['ttft_p99_s_on']:.3f} |",
        "",
        f"p50 speedup {rag['speedup']:.2f}x; bound 1/(1 - hit rate) = {rag['bound']:.2f}x "
        f"({rag['speedup'] / rag['bound']:.2f} of the bound)",
    ]
    return "\n".join(lines) + "\n"


def restore_lines(restore: dict) -> list[str]:
    """The restore table: each tier's times against a plain copy and a raw read of the same bytes."""
    if not restore:
        return []
    lines = [
        "",
        "| tier | MB | into the pool (ms) | into a transformers cache (ms) | plain copy (ms) | raw read (ms) "
        "| pool / copy | pool / raw read | recompute / pool |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in restore.items():
        pool, raw = row["pool_seconds"], row["raw_read_seconds"]
        raw_ms = "-" if raw is None else f"{raw * 1e3:.2f}"
        over_raw = "-" if raw is None else f"{pool / raw:.2f}x"
        lines.append(
            f"| {name} | {row['bytes'] / 1e6:.1f} | {pool * 1e3:.2f} | {row['library_seconds'] * 1e3:.2f} "
            f"| {row['copy_seconds'] * 1e3:.2f} | {raw_ms} | {pool / row['copy_seconds']:.2f}x | {over_raw} "
            f"| {row['recompute_seconds'] / pool:.1f}x |"
        )
    return [*lines, ""]
