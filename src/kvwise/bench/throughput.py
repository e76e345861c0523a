"""`kvwise bench throughput`: the engine against the usual transformers `generate` loops.

Workload (../docs BENCHMARKS "throughput"): 32 requests, prompt lengths
random.Random(7).randint(256, 1024) drawn in order, consecutive non-overlapping slices of the
essay tokens from token 0, raw token ids, exactly 64 new greedy tokens each (EOS ignored). All
requests arrive at time 0; TTFT is measured from then. Systems, same run: transformers
`generate` one request at a time, in batches of 8 with left padding, and kvwise's engine; with
`--compare vllm`, vLLM's CPU backend on the same token ids (`vllm_compare`), with its defaults and
with kvwise's batch limits.
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
from kvwise.bench.vllm_compare import WARMUP_TOKENS, parse_compare, vllm_setup_line, warmup_prompt
from kvwise.hf.cache import full_kv_bytes

AGREEMENT_TOKENS = 16  # leading greedy tokens compared with vLLM's
NEAR_TIE = 1e-3  # a top-2 logprob gap under this is a near-tie: float rounding may pick either
# (kvwise row, vLLM row) set side by side: each engine with its own limits, and each with the other's
VERSUS = (("kvwise", "vllm"), ("kvwise", "vllm-kvwise-limits"), ("kvwise-vllm-limits", "vllm"))


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
    compare: str | None = None  # "vllm": vLLM's CPU backend in the same run
    # run kvwise's engine once more with its step timed by part (`engine.step_profile`), after the
    # timed run and on a fresh engine (the timers cost a little, and a warm prefix cache would hide prefill)
    profile: bool = False

    def __post_init__(self):
        if self.requests < 1 or self.new_tokens < 1 or not 1 <= self.min_prompt <= self.max_prompt:
            raise ValueError("need requests >= 1, new_tokens >= 1 and 1 <= min_prompt <= max_prompt")
        if self.mix is not None:
            from kvwise.engine.kv_settings import resolve

            resolve(self.mix)  # a clear error for a bad mix (or one the engine does not run) before anything runs
            added = ("kvwise", "kvwise-mix", "library-full", "library-mix")
            self.systems = tuple(self.systems) + tuple(name for name in added if name not in self.systems)
        self.compare = parse_compare(self.compare)
        if (self.compare or self.profile) and "kvwise" not in self.systems:
            self.systems = (*self.systems, "kvwise")  # the row vLLM's are set against, and the one profiled


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


def run_kvwise(
    model, tokenizer, prompts, config: ThroughputConfig, progress, mix: str | None = None, limits=None
) -> dict:
    """The engine on every prompt at once; `mix`: the same KV mix on every request (compressed
    when its prompt's prefill ends); `limits`: another engine's (max_num_seqs,
    max_num_batched_tokens) instead of kvwise's own."""
    from kvwise.engine.llm import LLM, CacheConfig
    from kvwise.engine.sampling import SamplingParams

    cache_config = CacheConfig()
    if limits is not None:
        cache_config = CacheConfig(max_running=limits[0], token_budget=limits[1])
    llm = LLM(model, cache_config, tokenizer=tokenizer)
    params = SamplingParams(temperature=0, max_tokens=config.new_tokens, ignore_eos=True)
    warmup = SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
    llm.generate([warmup_prompt(prompts)], warmup, use_tqdm=False, kv=mix)  # as vLLM's runner does
    started = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False, kv=mix)
    requests = [request for output in outputs for request in output.requests]
    progress.update(len(requests))
    system = "kvwise" if mix is None else "kvwise-mix"
    row = _row(
        model,
        system if limits is None else "kvwise-vllm-limits",
        config,
        started,
        [r.first_token_time for r in requests],
        [r.finish_time for r in requests],
        llm.peak_blocks * llm.cache_config.block_size,
    )
    row["hit_rate"] = sum(r.reused for r in requests) / sum(len(r.prompt) for r in requests)
    row["config"] = {**row["config"], **asdict(llm.cache_config), "mix": mix}
    row["outputs"] = [list(r.output[:AGREEMENT_TOKENS]) for r in requests]
    if mix is not None:  # each prompt's KV right after compression, against the same prompt uncompressed
        token_bytes = llm.engine.kv.token_bytes
        shares = [r.compressed_kv_bytes / (len(r.prompt) * token_bytes) for r in requests]
        row["compressed_kv_share_max"], row["compressed_kv_share_mean"] = max(shares), statistics.mean(shares)
    if config.profile and mix is None and limits is None:
        del llm, outputs, requests  # the timed engine's pool goes before the profiled one's comes
        row["profile"] = profile_engine(model, tokenizer, prompts, params, warmup)
    return row


def profile_engine(model, tokenizer, prompts, params, warmup) -> dict:
    """The engine's step time by part (`StepProfile.summary`) over the workload, on a fresh engine."""
    from kvwise.engine.llm import LLM, CacheConfig

    llm = LLM(model, CacheConfig(), tokenizer=tokenizer)
    llm.generate([warmup_prompt(prompts)], warmup, use_tqdm=False)
    started = time.monotonic()
    with llm.engine.profiling() as profile:
        llm.generate(prompts, params, use_tqdm=False)
    return {**profile.summary(), "wall_seconds": time.monotonic() - started}


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


def run_vllm_systems(model, tokenizer, prompts, config: ThroughputConfig, progress) -> list[dict]:
    """vLLM's CPU backend on the same prompts, all arriving at once: with its defaults, and with
    kvwise's batch limits; each row also keeps its first output tokens and vLLM's top-2 logprobs."""
    from kvwise.bench.vllm_compare import run_vllm_settings

    rows = []
    runs = run_vllm_settings(model, tokenizer, prompts, config.new_tokens, logprob_tokens=AGREEMENT_TOKENS)
    for setting, result, shared in runs:
        requests = result["requests"]
        first, finished = [r["first_token_s"] for r in requests], [r["finish_s"] for r in requests]
        row = {**_row(model, setting.name, config, 0.0, first, finished, 0), **shared}
        row["config"] = {
            "vllm_version": result["vllm_version"],
            "engine_args": result["engine_args"],
            "effective": result["effective"],
            "threads_bind": result["threads_bind"],
        }
        row["outputs"] = [r["tokens"][:AGREEMENT_TOKENS] for r in requests]
        row["top_logprobs"] = [r.get("top_logprobs", []) for r in requests]
        rows.append(row)
        progress.update(len(prompts))
    return rows


def versus_vllm(results: list[dict]) -> list[dict]:
    """kvwise's engine against each vLLM row: output tok/s, TTFT p50 and TPOT p50 ratios, and the
    first greedy tokens of each request compared."""
    from kvwise.bench.vllm_compare import greedy_agreement

    rows = {row["system"]: row for row in results}
    summary = []
    for mine, peer in VERSUS:
        if mine not in rows or peer not in rows:
            continue
        ours, row = rows[mine], rows[peer]
        theirs = [{"tokens": tokens, "top_logprobs": top} for tokens, top in zip(row["outputs"], row["top_logprobs"])]
        summary.append(
            {
                "kvwise": mine,
                "vllm": peer,
                "tokens_per_second_ratio": _ratio(ours["tokens_per_second"], row["tokens_per_second"]),
                "ttft_p50_ratio": _ratio(ours["ttft_p50_s"], row["ttft_p50_s"]),
                "tpot_p50_ratio": _ratio(ours["tpot_p50_s"], row["tpot_p50_s"]),
                "agreement": greedy_agreement(ours["outputs"], theirs, AGREEMENT_TOKENS, NEAR_TIE),
            }
        )
    return summary


def _ratio(ours: float, theirs: float) -> float | None:
    """ours / theirs, or None where theirs is 0 (one new token: no time per output token)."""
    return ours / theirs if theirs else None


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
    from kvwise.bench.vllm_compare import VLLM
    from kvwise.models import load_model

    if config.compare:
        VLLM.python()  # made (or found) before anything runs: a failed install loses no measurement
    model, tokenizer = load_model(config.model, dtype=config.dtype)
    prompts = workload(tokenizer, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    runs = len(config.systems) + (3 if config.compare else 0)
    with tqdm(total=len(prompts) * runs, desc="throughput", unit="request") as progress:
        if config.compare:  # first: its defaults' limits are tried on kvwise too
            results += run_vllm_systems(model, tokenizer, prompts, config, progress)
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
        if config.compare:
            effective = results[0]["config"]["effective"]
            limits = (effective["max_num_seqs"], effective["max_num_batched_tokens"])
            results.append(run_kvwise(model, tokenizer, prompts, config, progress, limits=limits))
    fields = {"prompt_tokens": sum(map(len, prompts)), "results": results, "versus_vllm": versus_vllm(results)}
    report = new_report("throughput", config, model.device, **fields)
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
            f"{_bytes(row['peak_kv_bytes'])} |"
        )
    lines += _profile_lines(report)
    lines += _vllm_lines(report)
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


def _bytes(count: int | None) -> str:
    return "preallocated" if count is None else f"{count:,}"


def _vllm_lines(report: dict) -> list[str]:
    """kvwise against each vLLM configuration, and how vLLM ran."""
    lines = []
    for versus in report.get("versus_vllm", []):
        agreement = versus["agreement"]
        speed = (
            f"output tok/s {_times(versus['tokens_per_second_ratio'])}, TTFT p50 {_times(versus['ttft_p50_ratio'])}, "
            f"TPOT p50 {_times(versus['tpot_p50_ratio'])} (under 1 is faster for TTFT and TPOT)"
        )
        same = f"first {agreement['tokens']} greedy tokens the same in {agreement['same']} of {agreement['requests']}"
        ties = (
            f"{agreement['divergences_at_near_ties']} of the {agreement['requests'] - agreement['same']} divergences "
            f"at a near-tie (vLLM's top-2 logprob gap < {agreement['tie_threshold']:g})"
        )
        lines += ["", f"`{versus['kvwise']}` against `{versus['vllm']}`: {speed}; {same} requests, {ties}."]
    setup = vllm_setup_line(report["results"])
    if setup:
        lines += [
            "",
            setup + " `kvwise-vllm-limits`: kvwise's engine with `vllm`'s max_num_seqs and max_num_batched_tokens.",
        ]
    return lines


def _times(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def _profile_lines(report: dict) -> list[str]:
    """Where kvwise's step time went, from the profiled run (`--profile`)."""
    profiled = next((row for row in report["results"] if "profile" in row), None)
    if profiled is None:
        return []
    profile = profiled["profile"]
    tokens = profile["tokens"]
    lines = [
        "",
        f"Where kvwise's step time goes (`{profiled['system']}`, a second run with the step timed by part: "
        f"{profile['steps']} steps, {tokens['prefill']:,} prefill and {tokens['decode']:,} decode tokens, "
        f"{profile['wall_seconds']:.1f} s wall; linear time split between prefill and decode tokens by count):",
        "",
        "| part | seconds | share |",
        "|---|---|---|",
    ]
    for part, measured in profile["parts"].items():
        lines.append(f"| {part} | {measured['seconds']:.2f} | {measured['share']:.1%} |")
    return lines
