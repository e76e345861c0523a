"""`kvwise bench ppl`: teacher-forced perplexity under KV quantization and eviction budgets.

The workload is ../docs BENCHMARKS "ppl": the first `tokens` + 1 essay tokens, fed in fixed
chunks through one cache per system, the same tokens for every system. After each chunk the
cache compresses or quantizes; the next chunk's predictions pay for it. Every system runs in
the same process, after one warm-up forward; only model forwards are timed, and each system's
fastest of `repeats` passes is kept.

`--paths engine` scores kvwise's systems through the serving engine as well (`ppl_engine`):
after the first chunk, one token a step through its decode path, under the KV a generation
would hold there. Each path's ratios are against its own full cache.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from kvwise.bench.haystack import read_haystack
from kvwise.bench.hf_peers import backend_available, hf_cache_bytes, make_hf_quantized_cache
from kvwise.bench.ppl_engine import EngineScorer, measure_in_engine
from kvwise.bench.ppl_report import markdown_table, plot_ppl
from kvwise.bench.report_files import new_report, write_report
from kvwise.hf.cache import KVWiseCache, full_kv_bytes
from kvwise.kv.quantizer import make_quantizer
from kvwise.policies.mix import parse_mix
from kvwise.policies.registry import make_policy
from kvwise.util.partial import read_partial

PATHS = ("library", "engine")
HF_PEERS = {
    "quanto": [{"nbits": 4}, {"nbits": 4, "axis_key": -1}, {"nbits": 2}, {"nbits": 2, "axis_key": -1}],
    "hqq": [{"nbits": 4}, {"nbits": 2}],
}


@dataclass
class PplConfig:
    tokens: int = 4096
    chunk: int = 256
    quants: list[str] = field(default_factory=lambda: ["int8", "fp8", "kivi4", "kivi2"])
    policies: list[str] = field(default_factory=lambda: ["streaming_llm", "h2o", "tova", "snapkv", "keydiff"])
    budgets: list[int] = field(default_factory=lambda: [256, 512, 1024])
    mixes: list[str] = field(
        default_factory=lambda: ["h2o@max=1024+kivi4", "snapkv@max=512+kivi4", "h2o@max=1024+kivi2"]
    )
    peers: list[str] = field(default_factory=lambda: ["quanto", "hqq"])
    model: str | None = None
    dtype: str = "bfloat16"
    haystack_dir: str | None = None
    # Each system is scored this many times and its fastest pass is kept: on a shared 2-core
    # machine one pass can be 10-20% slow, which would swamp the differences being measured.
    repeats: int = 2
    # library: the library's cache, chunk by chunk (peers run here); engine: the serving engine,
    # after the first chunk one token a step through its decode path (bench/ppl_engine.py)
    paths: list[str] = field(default_factory=lambda: ["library"])

    def __post_init__(self):
        if self.tokens < 2 or not 1 <= self.chunk <= self.tokens:
            raise ValueError(f"tokens must be >= 2 and chunk in [1, tokens], got {self.tokens} and {self.chunk}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if not self.paths or len(set(self.paths)) < len(self.paths) or set(self.paths) - set(PATHS):
            raise ValueError(f"--paths takes one or both of {', '.join(PATHS)}, each once; got {','.join(self.paths)}")
        for name in self.quants:
            make_quantizer(name)
        for name in self.policies:
            make_policy(name)
        if any(budget < 1 for budget in self.budgets):
            raise ValueError(f"budgets must be positive, got {self.budgets}")
        for mix in self.mixes:
            if parse_mix(mix).max_tokens is None or parse_mix(mix).ratio > 0:
                raise ValueError(f"a perplexity mix caps each head (policy@max=N, with a quantizer); got {mix!r}")
        for peer in self.peers:
            if peer not in HF_PEERS:
                raise ValueError(f"unknown peer {peer!r}; choose from: {', '.join(HF_PEERS)}")

    def systems(self) -> list[dict]:
        """Every (system, config, path) of the run, in order: each path's full cache first, the
        baseline of its ratios. The engine path runs kvwise's systems only."""
        systems = []
        for path in self.paths:
            systems += [
                {**entry, "path": path}
                for entry in self._library_systems()
                if path == "library" or entry["system"] == "kvwise"
            ]
        return systems

    def _library_systems(self) -> list[dict]:
        systems = [{"system": "kvwise", "config": {"policy": "full", "max_kv_tokens": None, "quant": None}}]
        systems += [
            {"system": "kvwise", "config": {"policy": "full", "max_kv_tokens": None, "quant": q}} for q in self.quants
        ]
        for peer in self.peers:
            systems += [{"system": f"hf-{peer}", "config": dict(options)} for options in HF_PEERS[peer]]
        for policy in self.policies:
            systems += [
                {"system": "kvwise", "config": {"policy": policy, "max_kv_tokens": budget, "quant": None}}
                for budget in self.budgets
            ]
        for mix in self.mixes:
            parsed = parse_mix(mix)
            config = {"policy": parsed.policy, "max_kv_tokens": parsed.max_tokens, "quant": parsed.quant}
            systems.append({"system": "kvwise", "config": config})
        return systems


def essay_tokens(tokenizer, count: int, haystack_dir: str | None) -> torch.Tensor:
    """The first `count` tokens of the essays: [1, count]."""
    ids = tokenizer(read_haystack(haystack_dir), return_tensors="pt", add_special_tokens=False).input_ids
    if ids.shape[1] < count:
        raise ValueError(f"the essays hold {ids.shape[1]} tokens; the run needs {count}")
    return ids[:, :count]


def build_cache(model, entry: dict):
    config = entry["config"]
    if entry["system"] == "kvwise":
        return KVWiseCache(model, config["policy"], max_kv_tokens=config["max_kv_tokens"], quant=config["quant"])
    return make_hf_quantized_cache(model, entry["system"].removeprefix("hf-"), config["nbits"], config.get("axis_key"))


@torch.no_grad()
def score(model, ids: torch.Tensor, cache, chunk: int) -> tuple[float, float]:
    """Teacher-forced negative log-likelihood sum over ids[:, 1:] and seconds spent in forwards."""
    targets_total, nll, seconds = ids.shape[1] - 1, 0.0, 0.0
    for start in range(0, targets_total, chunk):
        end = min(start + chunk, targets_total)
        began = time.perf_counter()
        logits = model(input_ids=ids[:, start:end], cache=cache, use_cache=True).logits
        seconds += time.perf_counter() - began
        log_probs = torch.log_softmax(logits[0].float(), dim=-1)
        nll -= float(log_probs.gather(1, ids[0, start + 1 : end + 1, None]).sum())
    return nll, seconds


def measure(model, ids: torch.Tensor, entry: dict, chunk: int, repeats: int = 1) -> dict:
    """Score one system `repeats` times on fresh caches; the fastest pass gives the speed."""
    timings = []
    for _ in range(repeats):
        cache = build_cache(model, entry)
        nll, seconds = score(model, ids, cache, chunk)
        timings.append(seconds)
    seconds = min(timings)
    num_targets = ids.shape[1] - 1
    row = {
        **entry,
        "ppl": math.exp(nll / num_targets),
        "kv_bytes": cache.nbytes() if entry["system"] == "kvwise" else hf_cache_bytes(cache),
        "full_kv_bytes": full_kv_bytes(model, ids.shape[1] - 1, model.dtype.itemsize),
        "full16_kv_bytes": full_kv_bytes(model, ids.shape[1] - 1, 2),
        "tokens_per_second": num_targets / seconds,
        "seconds": seconds,
    }
    if entry["system"] == "kvwise":
        stats = cache.stats()
        row.update(
            {name: stats[name] for name in ("key_relative_error", "value_relative_error", "attention_relative_error")}
        )
    return row


def run_ppl(config: PplConfig, out_dir: Path, resume: bool = True) -> dict:
    from kvwise.models import load_model

    model, tokenizer = load_model(config.model, dtype=config.dtype)
    ids = essay_tokens(tokenizer, config.tokens + 1, config.haystack_dir).to(model.device)
    KVWiseCache(model).check_length(ids.shape[1])
    systems = [
        entry for entry in config.systems() if entry["system"] == "kvwise" or backend_available(entry["system"][3:])
    ]
    skipped = [entry for entry in config.systems() if entry not in systems]
    for entry in skipped:
        print(f"skipping {entry['system']} {entry['config']}: its package is not installed")
    out_dir.mkdir(parents=True, exist_ok=True)
    partial_path = out_dir / "ppl.partial.jsonl"
    done = _load_partial(partial_path, config) if resume else {}
    if not resume and partial_path.exists():
        partial_path.unlink()
    with torch.no_grad():  # warm-up: one-time costs must not land on the first system
        model(input_ids=ids[:, : config.chunk], cache=KVWiseCache(model), use_cache=True)
    scorer = None
    if "engine" in config.paths:
        scorer = EngineScorer(model, tokenizer)
        scorer.warm_up(ids, config.chunk, next(iter(config.quants), None))
    with partial_path.open("a") as partial, tqdm(total=len(systems), desc="ppl", unit="system") as progress:
        if not done:
            partial.write(json.dumps({"config": asdict(config)}) + "\n")
        for entry in systems:
            key = _key(entry)
            progress.set_postfix(
                system=entry["system"],
                path=entry["path"],
                **{k: v for k, v in entry["config"].items() if v is not None},
            )
            if key not in done:
                try:
                    if entry["path"] == "engine":
                        done[key] = measure_in_engine(scorer, model, ids, entry, config.chunk)
                    else:
                        done[key] = measure(model, ids, entry, config.chunk, config.repeats)
                except Exception as error:  # a peer library's own limits must not sink the run
                    if entry["system"] == "kvwise":
                        raise
                    print(f"skipping {entry['system']} {entry['config']}: {error}")
                    progress.update()
                    continue
                partial.write(json.dumps(done[key]) + "\n")
                partial.flush()
            progress.update()
    results = [done[_key(entry)] for entry in systems if _key(entry) in done]
    for row in results:
        row.setdefault("path", "library")  # a row resumed from a run before paths
    baselines = {row["path"]: row for row in reversed(results)}  # each path's first row: its full cache
    for row in results:
        baseline = baselines[row["path"]]
        row["ppl_ratio"] = row["ppl"] / baseline["ppl"]
        row["speed_vs_full"] = row["tokens_per_second"] / baseline["tokens_per_second"]
    report = new_report(
        "ppl", config, model.device, model_dtype=str(model.dtype).removeprefix("torch."), results=results
    )
    return write_report(out_dir, report, markdown_table, {"ppl.png": plot_ppl})


def _key(entry: dict) -> str:
    return json.dumps([entry["system"], entry["config"], entry.get("path", "library")], sort_keys=True)


def _load_partial(path: Path, config: PplConfig) -> dict:
    """Rows of an earlier run on the same tokens, model and dtype, keyed by system and config."""
    same = ("tokens", "chunk", "model", "dtype", "haystack_dir", "repeats")
    return read_partial(path, lambda previous: all(previous.get(n) == getattr(config, n) for n in same), _key)
