"""`kvwise bench rag`: prefix reuse under a serving workload, on the engine.

Workload (../docs BENCHMARKS "rag"): 70% of requests share a ~500-token system prompt; each
carries a 1,000-2,000-token document drawn with Zipf popularity from a pool of essay slices and
a 50-200-token question; 32 greedy output tokens. Requests come from `concurrency` clients, each
sending its next request when the previous one is answered (a closed loop), so TTFT is what a
user waits: queueing behind other prefills plus the request's own.

Systems, same run: transformers `generate` one request at a time, and kvwise's engine with
prefix caching off and on. The report sets the TTFT speedup beside the bound 1/(1 - hit rate).
With `--compress MIX`, also the engine compressing each system prompt + document once and
reusing it (`bench/rag_compress.py`), and the library path's answers for the same mix. With
`--compare vllm`, vLLM's CPU backend with its prefix caching on, on the same token ids and the
same closed loop (`vllm_compare`), with its defaults and with kvwise's batch limits.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvwise.bench.rag_compress import MATCH_TOKENS, compression_summary, document_hit_ttft, library_answers
from kvwise.bench.rag_workload import RagWorkload, rag_prompts
from kvwise.bench.report_files import model_label, new_report, system_line, write_report
from kvwise.bench.stats import percentile
from kvwise.bench.throughput import generate_timed
from kvwise.bench.vllm_compare import WARMUP_TOKENS, parse_compare, vllm_setup_line, warmup_prompt
from kvwise.engine.kv_settings import resolve
from kvwise.hf.cache import full_kv_bytes


@dataclass
class RagConfig(RagWorkload):
    model: str | None = None
    dtype: str | None = None  # None: the model's default (float32 on CPU), as `bench throughput`
    concurrency: int = 4
    systems: tuple[str, ...] = ("hf-sequential", "kvwise-reuse-off", "kvwise-reuse-on")
    compress: str | None = None  # a mix: also compress each document once and reuse it (kvwise-compress)
    compare: str | None = None  # "vllm": vLLM's CPU backend, prefix caching on, in the same run

    def __post_init__(self):
        super().__post_init__()
        if self.concurrency < 1 or self.output_tokens < 1:
            raise ValueError("need concurrency >= 1 and output_tokens >= 1")
        known = {"hf-sequential", "kvwise-reuse-off", "kvwise-reuse-on", "kvwise-compress", "library-compress"}
        unknown = set(self.systems) - known
        if unknown:
            raise ValueError(f"unknown systems {sorted(unknown)}; choose from {', '.join(sorted(known))}")
        if self.compress is not None:
            settings = resolve(self.compress)  # a clear error for a bad mix, before any run
            if not settings.evicts or settings.ratio <= 0:
                raise ValueError(f"--compress needs a policy with a ratio, such as 'kvzip@0.75'; got {self.compress!r}")
            wanted = ("kvwise-reuse-on", "kvwise-compress", "library-compress")
            self.systems = tuple(self.systems) + tuple(name for name in wanted if name not in self.systems)
        self.compare = parse_compare(self.compare)
        if self.compare and "kvwise-reuse-on" not in self.systems:
            self.systems = (*self.systems, "kvwise-reuse-on")  # the row vLLM's are set against


def run_engine(
    model, tokenizer, parts: list[tuple[list[int], int]], config: RagConfig, reuse: bool, progress, compress=None
) -> dict:
    """parts: (prompt ids, where its document ends). compress: a mix compressing each system
    prompt + document once, query-agnostically (needs reuse)."""
    from kvwise.engine.config import CacheConfig
    from kvwise.engine.core import EngineCore
    from kvwise.engine.sampling import SamplingParams

    core = EngineCore(model, tokenizer, CacheConfig(prefix_caching=reuse))
    params = SamplingParams(temperature=0, max_tokens=config.output_tokens, ignore_eos=True)
    kv = resolve(compress)
    _warm_up(core, [ids for ids, _ in parts])
    waiting, in_flight, done, in_order = list(parts), 0, [], []
    started = time.monotonic()
    while waiting or in_flight:
        while waiting and in_flight < config.concurrency:  # a client sends its next request
            ids, end = waiting.pop(0)
            request = core.make_request(ids, params, kv=kv, compress_upto=end if kv is not None else None)
            request.arrival = time.monotonic()
            core.add(request)
            in_order.append(request)
            in_flight += 1
        for event in core.step():
            if event.finish_reason is not None:
                in_flight -= 1
                done.append(event.request)
                progress.update()
    wall = time.monotonic() - started
    row = _row(
        "kvwise" if compress is None else "kvwise-compress",
        {"reuse": reuse, "concurrency": config.concurrency, "compress": compress, **asdict(core.cache_config)},
        wall,
        [r.first_token_time - r.arrival for r in done],
        [(r.finish_time - r.first_token_time) / max(len(r.output) - 1, 1) for r in done],
        config,
        len(done),
    )
    block = core.kv.block_size
    if kv is None:
        row["hit_rate"] = sum(r.reused for r in done) / sum(len(r.prompt) for r in done)
        hits = [end >= block and r.reused >= end // block * block for r, (_, end) in zip(in_order, parts)]
    else:
        hits = [r.compressed_hit for r in in_order]
        row["hit_rate"] = sum(end for hit, (_, end) in zip(hits, parts) if hit) / sum(len(r.prompt) for r in done)
        token_bytes = core.kv.token_bytes
        entries = core.kv.compressed_entries()
        held = [entry.region.nbytes / (len(entry.tokens) * token_bytes) for entry in entries]
        row["cached_document_bytes_ratio"] = statistics.mean(held) if held else None
    row["document_hits"] = sum(hits)
    row["document_hit_ttft_p50_s"] = document_hit_ttft(in_order, hits)
    row["outputs"] = [list(r.output) for r in in_order]
    row["peak_kv_bytes"] = core.kv.stats().peak_bytes
    return row


def _warm_up(core, prompts: list[list[int]]) -> None:
    """One request answered before the clock starts, as vLLM's runner does (it shares no prefix)."""
    from kvwise.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
    core.add(core.make_request(warmup_prompt(prompts), params))
    while core.has_work:
        core.step()


def run_vllm_systems(model, tokenizer, prompts: list[list[int]], config: RagConfig, progress):
    """vLLM with prefix caching on, the same prompts from the same closed loop of clients: with its
    defaults, and with kvwise's batch limits."""
    from kvwise.bench.vllm_compare import run_vllm_settings

    rows = []
    runs = run_vllm_settings(model, tokenizer, prompts, config.output_tokens, concurrency=config.concurrency)
    for setting, result, shared in runs:
        requests = result["requests"]
        ttft = [r["first_token_s"] - r["arrival_s"] for r in requests]
        tpot = [(r["finish_s"] - r["first_token_s"]) / max(len(r["tokens"]) - 1, 1) for r in requests]
        wall = max(r["finish_s"] for r in requests)
        settings = {
            "reuse": True,
            "concurrency": config.concurrency,
            "vllm_version": result["vllm_version"],
            "engine_args": result["engine_args"],
            "effective": result["effective"],
            "threads_bind": result["threads_bind"],
        }
        rows.append({**_row(setting.name, settings, wall, ttft, tpot, config, len(requests)), **shared})
        progress.update(len(prompts))
    return rows


def run_hf_sequential(model, prompts: list[list[int]], config: RagConfig, progress) -> dict:
    model.set_attn_implementation("sdpa")
    ttft, tpot, started = [], [], time.monotonic()
    for prompt in prompts:
        arrival, ids = time.monotonic(), torch.tensor([prompt])
        first, finished = generate_timed(model, ids, torch.ones_like(ids), config.output_tokens)
        ttft.append(first - arrival)
        tpot.append((finished - first) / max(config.output_tokens - 1, 1))
        progress.update()
    wall = time.monotonic() - started
    row = _row("hf-sequential", {"reuse": False, "concurrency": 1}, wall, ttft, tpot, config, len(prompts))
    row["peak_kv_bytes"] = full_kv_bytes(
        model, max(map(len, prompts)) + config.output_tokens, next(model.parameters()).dtype.itemsize
    )
    return row


def _row(system: str, settings: dict, wall: float, ttft: list[float], tpot: list[float], config, count: int) -> dict:
    return {
        "system": system,
        "config": settings,
        "tokens_per_second": count * config.output_tokens / wall,
        "requests_per_second": count / wall,
        "wall_seconds": wall,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": statistics.median(tpot),
        "hit_rate": 0.0,
        "peak_kv_bytes": 0,
    }


def run_rag(config: RagConfig, out_dir: Path) -> dict:
    from kvwise.bench.vllm_compare import VLLM
    from kvwise.models import load_model

    if config.compare:
        VLLM.python()  # made (or found) before anything runs: a failed install loses no measurement
    model, tokenizer = load_model(config.model, dtype=config.dtype)
    parts = rag_prompts(tokenizer, config)
    prompts = [ids for ids, _ in parts]
    out_dir.mkdir(parents=True, exist_ok=True)
    results, library = [], None
    runs = len(config.systems) + (2 if config.compare else 0)
    with tqdm(total=len(prompts) * runs, desc="rag", unit="request") as progress:
        if config.compare:  # first: should its runner fail, no measurement of kvwise's is lost
            results += run_vllm_systems(model, tokenizer, prompts, config, progress)
        for system in config.systems:
            if system == "hf-sequential":
                results.append(run_hf_sequential(model, prompts, config, progress))
            elif system == "library-compress":
                library = library_answers(model, tokenizer, parts, config.compress, config.output_tokens, progress)
            elif system == "kvwise-compress":
                results.append(run_engine(model, tokenizer, parts, config, True, progress, config.compress))
            else:
                results.append(run_engine(model, tokenizer, parts, config, system.endswith("-on"), progress))
    summary = {}
    by_reuse = {row["config"]["reuse"]: row for row in results if row["system"] == "kvwise"}
    if len(by_reuse) == 2:
        hit = by_reuse[True]["hit_rate"]
        summary = {
            "ttft_p50_speedup": by_reuse[False]["ttft_p50_s"] / by_reuse[True]["ttft_p50_s"],
            "ttft_p99_speedup": by_reuse[False]["ttft_p99_s"] / by_reuse[True]["ttft_p99_s"],
            "bound": 1.0 / max(1.0 - hit, 1e-9),
        }
    if True in by_reuse:
        summary["versus_vllm"] = [
            {"vllm": row["system"], "ttft_p50_ratio": by_reuse[True]["ttft_p50_s"] / row["ttft_p50_s"]}
            for row in results
            if row["system"].startswith("vllm")
        ]
    compressed = next((row for row in results if row["system"] == "kvwise-compress"), None)
    if compressed is not None and True in by_reuse:
        summary["compress"] = compression_summary(by_reuse[True], compressed, library)
    fields = {"prompt_tokens": sum(map(len, prompts)), "summary": summary, "results": results}
    return write_report(out_dir, new_report("rag", config, model.device, **fields), markdown)


def markdown(report: dict) -> str:
    config, summary = report["config"], report["summary"]
    lines = [
        f"RAG serving, {config['requests']} requests ({report['prompt_tokens']:,} prompt tokens), "
        f"{config['concurrency']} clients in a closed loop, {config['output_tokens']} output tokens each, "
        f"model={model_label(config)}",
        system_line(report["system"]),
        "",
        "| system | reuse | TTFT p50 / p99 (s) | TPOT p50 (s) | output tok/s | req/s | hit rate | peak KV bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        lines.append(
            f"| {row['system']} | {_reuse_label(row)} | "
            f"{row['ttft_p50_s']:.3f} / {row['ttft_p99_s']:.3f} | {row['tpot_p50_s']:.3f} | "
            f"{row['tokens_per_second']:.2f} | {row['requests_per_second']:.3f} | {row['hit_rate']:.3f} | "
            f"{'preallocated' if row['peak_kv_bytes'] is None else format(row['peak_kv_bytes'], ',')} |"
        )
    if "ttft_p50_speedup" in summary:
        lines += [
            "",
            f"TTFT p50 with reuse {summary['ttft_p50_speedup']:.2f}x better than without (p99 "
            f"{summary['ttft_p99_speedup']:.2f}x); bound 1/(1 - hit rate) = {summary['bound']:.2f}x",
        ]
    setup = vllm_setup_line(report["results"])
    if setup:
        lines += ["", setup]
    for versus in summary.get("versus_vllm", []):
        lines += [
            "",
            f"kvwise with reuse against `{versus['vllm']}` (prefix caching on): "
            f"TTFT p50 {versus['ttft_p50_ratio']:.2f}x (under 1: kvwise answers sooner).",
        ]
    if "compress" in summary:
        compress, rows = summary["compress"], {row["system"]: row for row in report["results"]}
        plain = next(row for row in report["results"] if row["system"] == "kvwise" and row["config"]["reuse"])
        squeezed = rows["kvwise-compress"]
        lines += [
            "",
            f"Compress once with `{config['compress']}`: requests that found their document cached had TTFT p50 "
            f"{squeezed['document_hit_ttft_p50_s']:.3f} s ({squeezed['document_hits']} requests) against "
            f"{plain['document_hit_ttft_p50_s']:.3f} s with plain reuse ({plain['document_hits']}): "
            f"{compress['hit_ttft_ratio']:.2f}x. A cached document holds {compress['cached_bytes_ratio']:.3f} "
            f"of its uncompressed KV bytes. First {MATCH_TOKENS} output tokens equal to the full cache's: "
            f"{compress['first_tokens_match_full']:.0%}"
            + (
                f"; to the library path's with the same mix: {compress['first_tokens_match_library']:.0%}"
                if "first_tokens_match_library" in compress
                else ""
            )
            + ".",
        ]
    return "\n".join(lines) + "\n"


def _reuse_label(row: dict) -> str:
    if row["system"].startswith("vllm"):
        return "on (vLLM prefix caching)"
    if row["config"].get("compress"):
        return f"on, {row['config']['compress']}"
    return "on" if row["config"]["reuse"] else "off"
