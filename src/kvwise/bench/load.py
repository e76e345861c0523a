"""`kvwise bench load`: many streaming clients against a live server, some hanging up mid-stream.

A server on loopback (the embedded model by default), `clients` threads each streaming
completions back to back for `duration_seconds`; a `hangup_fraction` of the streams close the
connection after a few chunks, and a `cancel_fraction` of the requests give up before their
first token (a client timeout: cancelled while queued or prefilling). With `tier_faults`, the
prefix cache spills to a disk tier whose files are corrupted and truncated under the server and
whose disk fills up and empties again (`bench.tier_faults`). Reported: status codes, TTFT and
TPOT percentiles of the streams that finished, process memory and pool blocks over time, the
faults injected and what the tier counted, and once the server is idle again the blocks still
held outside the prefix cache and the prefix-cache locks (both must be 0).
"""

from __future__ import annotations

import os
import random
import resource
import secrets
import shutil
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvwise.bench.report_files import model_label, new_report, write_report
from kvwise.bench.stats import percentile
from kvwise.bench.tier_faults import FillingDiskTier, TierFaults


@dataclass
class LoadConfig:
    model: str | None = None
    clients: int = 64
    duration_seconds: float = 60.0
    hangup_fraction: float = 0.25
    cancel_fraction: float = 0.1
    tier_faults: bool = False
    num_blocks: int | None = None  # None: CacheConfig's default (a small pool makes the tiers work)
    max_tokens: int = 32
    shared_starts: int = 32  # distinct places prompts start at (their shared prefixes)
    prompt_words: tuple[int, int] = (16, 160)
    max_queue: int = 256
    seed: int = 0

    def __post_init__(self):
        if self.clients < 1 or self.duration_seconds <= 0:
            raise ValueError("clients must be >= 1 and duration_seconds > 0")
        if not (0 <= self.hangup_fraction <= 1 and 0 <= self.cancel_fraction <= 1):
            raise ValueError("hangup_fraction and cancel_fraction must be in [0, 1]")
        if self.shared_starts < 1:
            raise ValueError(f"shared_starts must be >= 1, got {self.shared_starts}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


def _rss_bytes() -> int:
    try:
        with open(f"/proc/{os.getpid()}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _client(base_url: str, config: LoadConfig, words: list[str], index: int, deadline: float, records: list) -> None:
    import httpx

    rng = random.Random(f"{config.seed}-{index}")
    # prompts start at one of a few places, so they share prefixes as real traffic does, and the
    # prefix cache (and with tier_faults, its disk tier) is exercised
    starts = random.Random(config.seed).sample(range(len(words) - config.prompt_words[1]), config.shared_starts)
    with httpx.Client(base_url=base_url, timeout=120) as http:
        while time.monotonic() < deadline:
            start = rng.choice(starts)
            prompt = " ".join(words[start : start + rng.randint(*config.prompt_words)])
            body = {"model": "load", "prompt": prompt, "max_tokens": config.max_tokens, "stream": True}
            if rng.random() < config.cancel_fraction:
                records.append(_cancelled_request(base_url, body, rng.uniform(0.02, 0.5)))
                continue
            hang_up_after = rng.randint(1, 4) if rng.random() < config.hangup_fraction else None
            sent, first, chunks, status = time.monotonic(), None, 0, None
            try:
                with http.stream("POST", "/v1/completions", json=body) as answer:
                    status = answer.status_code
                    for line in answer.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunks += 1
                        first = first or time.monotonic()
                        if hang_up_after is not None and chunks >= hang_up_after:
                            break  # leaving the block closes the connection mid-stream
            except httpx.HTTPError as error:
                status = f"error:{type(error).__name__}"
            finished = time.monotonic()
            records.append(
                {
                    "status": status,
                    "hung_up": hang_up_after is not None,
                    "cancelled": False,
                    "ttft": None if first is None else first - sent,
                    "tpot": None if first is None or chunks < 2 else (finished - first) / (chunks - 1),
                }
            )


def _cancelled_request(base_url: str, body: dict, after_seconds: float) -> dict:
    """A request whose client gives up after `after_seconds`, on its own connection (a timeout
    closes it): usually while it is queued or prefilling, sometimes once it has answered."""
    import httpx

    status = "cancelled"
    try:
        with httpx.Client(base_url=base_url, timeout=after_seconds) as http:
            status = http.post("/v1/completions", json={**body, "stream": False}).status_code
    except httpx.TimeoutException:
        pass
    except httpx.HTTPError as error:
        status = f"error:{type(error).__name__}"
    return {"status": status, "hung_up": False, "cancelled": True, "ttft": None, "tpot": None}


def run_load(config: LoadConfig, out_dir: Path) -> dict:
    from kvwise.bench.haystack import read_haystack
    from kvwise.bench.loopback_server import LoopbackServer
    from kvwise.engine.config import CacheConfig
    from kvwise.engine.core import EngineCore
    from kvwise.models import load_model
    from kvwise.server.app import ServerSettings, create_app

    model, tokenizer = load_model(config.model)
    words = read_haystack().split()
    cache = CacheConfig() if config.num_blocks is None else CacheConfig(num_blocks=config.num_blocks)
    faults = None
    if config.tier_faults:
        folder = Path(tempfile.mkdtemp(prefix="kvwise-load-disk-"))
        faults = TierFaults(FillingDiskTier(folder, mac_key=secrets.token_bytes(32)), seed=config.seed)
    core = EngineCore(model, tokenizer, cache, tiers=[faults.disk] if faults else ())
    server = LoopbackServer(create_app(core, ServerSettings("load", max_queue=config.max_queue)))
    records: list[dict] = []
    samples: list[dict] = []
    started = time.monotonic()
    deadline = started + config.duration_seconds
    stop_sampling = threading.Event()

    def sample():
        while not stop_sampling.wait(0.5):
            used = core.kv.stats().used_blocks
            samples.append({"t": time.monotonic() - started, "rss_bytes": _rss_bytes(), "used_blocks": used})

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if faults is not None:
        faults.start()
    threads = [
        threading.Thread(target=_client, args=(server.base_url, config, words, i, deadline, records), daemon=True)
        for i in range(config.clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(config.duration_seconds + 300)
    if faults is not None:
        faults.stop()
    idle_deadline = time.monotonic() + 60
    while (core.scheduler.running or core.scheduler.waiting) and time.monotonic() < idle_deadline:
        time.sleep(0.1)  # hung-up requests are cancelled on the engine thread
    stop_sampling.set()
    sampler.join()
    tree_blocks, locks = core.kv.prefix_cache_holdings()
    leaked = core.kv.stats().used_blocks - tree_blocks
    server.stop()
    if faults is not None:
        shutil.rmtree(faults.disk.directory, ignore_errors=True)
    summary = _summary(records, samples, faults, leaked, locks)
    results = {"summary": summary, "samples": samples, "requests": records}
    report = new_report("load", config, model.device, results=results)
    return write_report(out_dir, report, markdown, {"load_memory.png": _plot})


def _summary(records: list[dict], samples: list[dict], faults, leaked: int, locks: int) -> dict:
    """The run in figures: outcomes, injected faults, latencies of completed streams, memory, leaks."""
    done = [r for r in records if not r["hung_up"] and not r["cancelled"] and r["ttft"] is not None]
    ttfts, tpots = [r["ttft"] for r in done], [r["tpot"] for r in done if r["tpot"] is not None]
    return {
        "requests": len(records),
        "hung_up": sum(r["hung_up"] for r in records),
        "cancelled": sum(r["cancelled"] for r in records),
        "faults_injected": dict(faults.counts) if faults is not None else {},
        "tier": _tier_counts(faults.disk) if faults is not None else {},
        "statuses": dict(Counter(str(r["status"]) for r in records)),
        "ttft_p50": percentile(ttfts, 0.5) if ttfts else None,
        "ttft_p99": percentile(ttfts, 0.99) if ttfts else None,
        "tpot_p50": percentile(tpots, 0.5) if tpots else None,
        "tpot_p99": percentile(tpots, 0.99) if tpots else None,
        "peak_rss_bytes": max((s["rss_bytes"] for s in samples), default=_rss_bytes()),
        "leaked_blocks": leaked,
        "prefix_locks": locks,
    }


def _tier_counts(disk) -> dict:
    stats = disk.stats
    return {"hits": stats.hits, "puts": stats.puts, "refused_puts": stats.refused_puts, "corrupt": stats.corrupt}


def markdown(report: dict) -> str:
    config, summary = report["config"], report["results"]["summary"]

    def seconds(value):
        return "-" if value is None else f"{value:.3f}"

    return "\n".join(
        [
            f"Load, model={model_label(config)}, {config['clients']} streaming clients for "
            f"{config['duration_seconds']:.0f} s, {config['hangup_fraction']:.0%} hang up mid-stream, "
            f"{config.get('cancel_fraction', 0):.0%} give up before their first token, "
            f"{config['max_tokens']} tokens each"
            + (f", {config['num_blocks']} pool blocks" if config.get("num_blocks") else "")
            + (", disk-tier faults injected" if config.get("tier_faults") else ""),
            "",
            "| requests | hung up | cancelled | statuses | TTFT p50 / p99 (s) | TPOT p50 / p99 (s) | peak RSS (MB) | "
            "leaked blocks | prefix locks |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| {summary['requests']} | {summary['hung_up']} | {summary.get('cancelled', 0)} | "
            + ", ".join(f"{code}: {count}" for code, count in sorted(summary["statuses"].items()))
            + f" | {seconds(summary['ttft_p50'])} / {seconds(summary['ttft_p99'])} | "
            f"{seconds(summary['tpot_p50'])} / {seconds(summary['tpot_p99'])} | "
            f"{summary['peak_rss_bytes'] / 2**20:.0f} | {summary['leaked_blocks']} | {summary['prefix_locks']} |",
            "",
            *_faults_lines(summary),
        ]
    )


def _faults_lines(summary: dict) -> list[str]:
    if not summary.get("faults_injected"):
        return []
    injected = ", ".join(f"{kind} {count}" for kind, count in sorted(summary["faults_injected"].items()))
    tier = summary["tier"]
    return [
        f"Disk-tier faults injected: {injected}. The tier counted {tier['corrupt']} corrupt entries (each a miss, "
        f"recomputed), {tier['refused_puts']} refused writes, {tier['puts']} writes and {tier['hits']} hits.",
        "",
    ]


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["results"]["samples"]
    figure, memory = plt.subplots(figsize=(7, 3.5))
    times = [s["t"] for s in samples]
    memory.plot(times, [s["rss_bytes"] / 2**20 for s in samples], label="process RSS (MB)")
    memory.set_xlabel("seconds")
    memory.set_ylabel("MB")
    blocks = memory.twinx()
    blocks.plot(times, [s["used_blocks"] for s in samples], color="tab:orange", label="pool blocks in use")
    blocks.set_ylabel("blocks")
    figure.legend(loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
