"""`kvwise bench throughput`: the engine against the usual transformers `generate` loops.

Workload (../docs BENCHMARKS "throughput"): 32 requests, prompt lengths
random.Random(7).randint(256, 1024) drawn in order, consecutive non-overlapping slices of the
essay tokens from token 0, raw token ids, exactly 64 new greedy tokens each (EOS ignored). All
requests arrive at time 0; TTFT is measured from then. Systems, same run: transformers
`generate` one request at a time, in batches of 8 with left padding, and kvwise's engine.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer

from kvwise.bench.haystack import read_haystack
from kvwise.bench.report_files import model_label, new_report, system_line, write_report
from kvwise.bench.stats import percentile
from kvwise.hf.cache import full_kv_bytes


@dataclass
class ThroughputConfig:
    requests: int = 32
    min_prompt: int = 256
    max_prompt: int = 1024
    new_tokens: int = 64
    batch_size: int = 8
    model: str | None = None
    dtype: str | None = None  # None: the model's default (float32 on CPU)
    systems: tuple[str, ...] = ("hf-sequential", "hf-batched", "kvwise")
    # a KV mix on every request (e.g. kvzip@0.9): adds the engine with it, and the library path
    # (KVWiseCache, one request at a time) with it and without, for the ratio of their times
    mix: str | None = None

    def __post_init__(self):
        if self.requests < 1 or self.new_tokens < 1 or not 1 <= self.min_prompt <= self.max_prompt:
            raise ValueError("need requests >= 1, new_tokens >= 1 and 1 <= min_prompt <= max_prompt")
        if self.mix is not None:
            from kvwise.engine.kv_settings import resolve

            resolve(self.mix)  # a clear error for a bad mix (or one the engine does not run) before anything runs
            added = ("kvwise", "kvwise-mix", "library-full", "library-mix")
            self.systems = tuple(self.systems) + tuple(name for name in added if name not in self.systems)


def workload(tokenizer, config: ThroughputConfig) -> list[list[int]]:
    rng = random.Random(7)
    lengths = [rng.randint(config.min_prompt, config.max_prompt) for _ in range(config.requests)]
    stream = tokenizer(read_haystack(), add_special_tokens=False).input_ids
    if sum(lengths) > len(stream):
        raise ValueError(f"the essays hold {len(stream)} tokens; the workload needs {sum(lengths)}")
    starts = [sum(lengths[:index]) for index in range(len(lengths))]
    return [stream[start : start + length] for start, length in zip(starts, lengths)]


class _FirstToken(BaseStreamer):
    """Records when generate produces its first new token (its first `put` is the prompt)."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.first = time.monotonic()

    def end(self):
        pass


def generate_timed(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """Greedy `generate` of exactly `new_tokens` tokens for ids [batch, length] (mask alike);
    returns when its first new token came out and when it finished (time.monotonic())."""
    streamer = _FirstToken()
    with torch.no_grad():
        model.generate(
            ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            streamer=streamer,
        )
    done = time.monotonic()
    return (streamer.first if streamer.first is not None else done), done


def run_hf(model, prompts, config: ThroughputConfig, batch_size: int, progress) -> dict:
    model.set_attn_implementation("sdpa")
    started, first, finished = time.monotonic(), [], []
    peak_tokens = 0
    for begin in range(0, len(prompts), batch_size):
        batch = prompts[begin : begin + batch_size]
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, prompt in enumerate(batch):  # left padding
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        first_token, done = generate_timed(model, ids, mask, config.new_tokens)
        first += [first_token] * len(batch)
        finished += [done] * len(batch)
        peak_tokens = max(peak_tokens, len(batch) * (width + config.new_tokens))
        progress.update(len(batch))
    return _row(
        model, "hf-sequential" if batch_size == 1 else "hf-batched", config, started, first, finished, peak_tokens
    )


def run_kvwise(model, tokenizer, prompts, config: ThroughputConfig, progress, mix: str | None = None) -> dict:
    """The engine on every prompt at once; `mix`: the same KV mix on every request (compressed
    when its prompt's prefill ends)."""
    from kvwise.engine.llm import LLM, CacheConfig
    from kvwise.engine.sampling import SamplingParams

    llm = LLM(model, CacheConfig(), tokenizer=tokenizer)
    params = SamplingParams(temperature=0, max_tokens=config.new_tokens, ignore_eos=True)
    started = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False, kv=mix)
    requests = [request for output in outputs for request in output.requests]
    progress.update(len(requests))
    row = _row(
        model,
        "kvwise" if mix is None else "kvwise-mix",
        config,
        started,
        [r.first_token_time for r in requests],
        [r.finish_time for r in requests],
        llm.peak_blocks * llm.cache_config.block_size,
    )
    row["hit_rate"] = sum(r.reused for r in requests) / sum(len(r.prompt) for r in requests)
    row["config"] = {**row["config"], **asdict(llm.cache_config), "mix": mix}
    if mix is not None:  # each prompt's KV right after compression, against the same prompt uncompressed
        token_bytes = llm.engine.kv.token_bytes
        shares = [r.compressed_kv_bytes / (len(r.prompt) * token_bytes) for r in requests]
        row["compressed_kv_share_max"], row["compressed_kv_share_mean"] = max(shares), statistics.mean(shares)
    return row


def run_library(model, tokenizer, prompts, config: ThroughputConfig, progress, mix: str | None) -> dict:
    """The library path one request at a time: KVWiseCache with `mix` (or the full cache) over all
    but the last prompt token, compressed, then the last token and greedy decoding."""
    from kvwise.hf.cache import KVWiseCache
    from kvwise.hf.generation import greedy_continue

    started, first, finished = time.monotonic(), [], []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        cache = KVWiseCache.for_mix(model, mix or "full", tokenizer)
        cache.compress_context(ids[:, :-1])
        token = greedy_continue(model, cache, ids[:, -1:], 1)
        first.append(time.monotonic())
        greedy_continue(model, cache, token, config.new_tokens - 1)
        finished.append(time.monotonic())
        progress.update()
    row = _row(model, "library-full" if mix is None else "library-mix", config, started, first, finished, 0)
    row["config"] = {"mix": mix}
    return row


def _row(model, system, config, started, first, finished, peak_tokens) -> dict:
    ttft = [moment - started for moment in first]
    tpot = [(end - begin) / max(config.new_tokens - 1, 1) for begin, end in zip(first, finished)]
    wall = max(finished) - started
    return {
        "system": system,
        "config": {"batch_size": config.batch_size if system == "hf-batched" else None},
        "tokens_per_second": config.requests * config.new_tokens / wall,
        "wall_seconds": wall,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": statistics.median(tpot),
        "hit_rate": 0.0,
        "peak_kv_bytes": full_kv_bytes(model, peak_tokens, next(model.parameters()).dtype.itemsize),
    }


def run_throughput(config: ThroughputConfig, out_dir: Path) -> dict:
    from kvwise.models import load_model

    model, tokenizer = load_model(config.model, dtype=config.dtype)
    prompts = workload(tokenizer, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    with tqdm(total=len(prompts) * len(config.systems), desc="throughput", unit="request") as progress:
        for system in config.systems:
            if system == "kvwise":
                results.append(run_kvwise(model, tokenizer, prompts, config, progress))
            elif system == "kvwise-mix":
                results.append(run_kvwise(model, tokenizer, prompts, config, progress, config.mix))
            elif system.startswith("library-"):
                mix = config.mix if system == "library-mix" else None
                results.append(run_library(model, tokenizer, prompts, config, progress, mix))
            else:
                size = 1 if system == "hf-sequential" else config.batch_size
                results.append(run_hf(model, prompts, config, size, progress))
    report = new_report("throughput", config, model.device, prompt_tokens=sum(map(len, prompts)), results=results)
    return write_report(out_dir, report, markdown)


def markdown(report: dict) -> str:
    config = report["config"]
    baseline = {row["system"]: row["tokens_per_second"] for row in report["results"]}
    lines = [
        f"Throughput, {config['requests']} requests, prompts {config['min_prompt']}-{config['max_prompt']} tokens "
        f"({report['prompt_tokens']:,} in all), {config['new_tokens']} new tokens each, "
        f"model={model_label(config)}",
        system_line(report["system"]),
        "",
        "| system | output tok/s | vs sequential | vs batched | wall (s) | TTFT p50 / p99 (s) | TPOT p50 (s) | "
        "hit rate | peak KV bytes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        speed = row["tokens_per_second"]
        versus = [
            f"{speed / baseline[name]:.2f}x" if name in baseline else "" for name in ("hf-sequential", "hf-batched")
        ]
        lines.append(
            f"| {row['system']} | {speed:.2f} | {versus[0]} | {versus[1]} | {row['wall_seconds']:.1f} | "
            f"{row['ttft_p50_s']:.2f} / {row['ttft_p99_s']:.2f} | {row['tpot_p50_s']:.3f} | {row['hit_rate']:.3f} | "
            f"{row['peak_kv_bytes']:,} |"
        )
    rows = {row["system"]: row for row in report["results"]}
    if {"kvwise", "kvwise-mix", "library-full", "library-mix"} <= set(rows):
        engine = rows["kvwise-mix"]["wall_seconds"] / rows["kvwise"]["wall_seconds"]
        library = rows["library-mix"]["wall_seconds"] / rows["library-full"]["wall_seconds"]
        lines += [
            "",
            f"`{config['mix']}` on every request: the engine's wall time {engine:.2f}x its own without it "
            f"(the library path: {library:.2f}x). Each prompt's KV after compression: at most "
            f"{rows['kvwise-mix']['compressed_kv_share_max']:.3f} of the same prompt uncompressed "
            f"(mean {rows['kvwise-mix']['compressed_kv_share_mean']:.3f}).",
        ]
    return "\n".join(lines) + "\n"
