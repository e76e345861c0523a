"""`kvwise bench niah`: needle-in-a-haystack retrieval under KV compression.

The workload is ../docs BENCHMARKS "niah". Each trial is timed end to end (prefill, compression,
question, 8 greedy tokens). Results stream to `niah.partial.jsonl` so an interrupted run resumes.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from kvwise.bench.byte_budget import DEFAULT_BUDGET_MIXES, ByteSizer, budget_mix, check_budgets
from kvwise.bench.environment import system_info
from kvwise.bench.haystack import (
    DEFAULT_ANSWER_PREFIX,
    DEFAULT_NEEDLE,
    DEFAULT_QUESTION,
    NeedlePromptBuilder,
    read_haystack,
    split_essays,
    trial_grid,
)
from kvwise.bench.kvpress_compare import run_kvpress
from kvwise.bench.kvpress_venv import KvpressUnavailable
from kvwise.bench.peak_memory import PeakMemory
from kvwise.hf.cache import KVWiseCache, full_kv_bytes
from kvwise.hf.generation import greedy_continue
from kvwise.kv.quantizer import make_quantizer
from kvwise.kv.stored_form import StoredForm
from kvwise.policies.registry import make_policy
from kvwise.policies.selection import check_ratio
from kvwise.util.partial import read_partial

NUM_NEW_TOKENS = 8
PATHS = ("library", "engine")

log = logging.getLogger("kvwise.bench")


# `kvwise bench niah --long`: one run per length (each its own folder, each resumable). KVzip's
# pass reads the context twice, so at 8000 tokens one pass would need 16K positions: the embedded
# model has 8K, so KVzip re-reads there in chunks (`pass_chunk`).
LONG_GRIDS = (
    {
        "lengths": [4000],
        "policies": ["full", "kvzip:recent_window=64", "kvzap:recent_window=64"],
        "ratios": [0.9, 0.95],
        "budget_bytes": [0.05],
        # int8 over kivi4 at 4000 tokens: kivi4's 4-bit codes lost needles KVzip kept (docs/benchmarks.md)
        "mixes": ["kvzap:recent_window=64+kivi4", "kvzip:recent_window=64+int8"],
    },
    {
        "lengths": [8000],
        "policies": ["full"],
        "ratios": [0.9],
        "budget_bytes": [0.05],
        "mixes": ["kvzap+kivi4", "kvzip:pass_chunk=128+kivi4"],  # 128-token re-reads fit in 8K positions
    },
)


@dataclass
class NiahConfig:
    policies: list[str] = field(default_factory=lambda: ["full", "streaming_llm", "snapkv", "kvzip"])
    ratios: list[float] = field(default_factory=lambda: [0.5, 0.75, 0.9])
    lengths: list[int] = field(default_factory=lambda: [1000, 2000, 4000])
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    trials_per_depth: int = 2
    mode: str = "agnostic"
    model: str | None = None
    seed: int = 0
    haystack_dir: str | None = None
    needle: str = DEFAULT_NEEDLE
    question: str = DEFAULT_QUESTION
    answer_prefix: str = DEFAULT_ANSWER_PREFIX
    quant: str | None = None  # a quantizer for every cell: evict with the policy, then quantize
    # where the trials run: "library" (KVWiseCache), "engine" (the serving engine, kvwise.LLM), or
    # both, cells interleaved trial by trial
    paths: list[str] = field(default_factory=lambda: ["library"])
    # equal-bytes cells: each mix at the ratio that holds each budget (a fraction of a 16-bit full cache)
    budget_bytes: list[float] = field(default_factory=list)
    mixes: list[str] = field(default_factory=list)
    # kvpress presses run on the same trials at the same ratios, in kvpress's own venv
    compare: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.mode not in ("agnostic", "aware"):
            raise ValueError(f"mode must be 'agnostic' or 'aware', got {self.mode!r}")
        for name in self.policies:
            policy_options(name)
        for ratio in self.ratios:
            check_ratio(ratio)
        if any(length < 16 for length in self.lengths):
            raise ValueError("lengths must be at least 16 tokens")
        if any(not 0.0 <= depth <= 1.0 for depth in self.depths):
            raise ValueError("depths must be in [0, 1]")
        if self.trials_per_depth < 1:
            raise ValueError("trials-per-depth must be >= 1")
        make_quantizer(self.quant)
        if "{key}" not in self.needle:
            raise ValueError("the needle template must contain {key}")
        self.budget_bytes = check_budgets(self.budget_bytes)
        if self.budget_bytes and not self.mixes:
            self.mixes = list(DEFAULT_BUDGET_MIXES)
        if self.mixes and not self.budget_bytes:
            raise ValueError("--mixes runs each mix at the ratio that holds a byte budget: give --budget-bytes too")
        unknown = [path for path in self.paths if path not in PATHS]
        if unknown or not self.paths or len(set(self.paths)) < len(self.paths):
            raise ValueError(f"--paths takes one or both of {', '.join(PATHS)}, each once; got {','.join(self.paths)}")
        for mix in self.mixes:
            budget_mix(mix)

    def cells(self) -> list[tuple[str, float]]:
        """(policy, ratio) pairs; `full` runs once, at ratio 0, since it never compresses."""
        pairs = []
        for name in self.policies:
            ratios = [0.0] if name == "full" else self.ratios
            pairs.extend((name, ratio) for ratio in ratios)
        return pairs

    def budget_cells(self) -> list[tuple[str, float]]:
        """(mix, budget) pairs of the equal-bytes grid."""
        return [(mix, budget) for budget in self.budget_bytes for mix in self.mixes]


def policy_options(spec: str) -> tuple[str, tuple]:
    """A --policies entry, `kvzip` or with options `kvzip:recent_window=32`: (policy, options)."""
    make_policy(spec.split(":", 1)[0].split("+", 1)[0].strip())  # an unknown name: the registry's error
    mix = budget_mix(spec)
    if mix.quant is not None:
        raise ValueError(f"policy {spec!r} names a quantizer: give it with --quant, or as a mix with --budget-bytes")
    return mix.policy, mix.options


def run_trial(
    model, tokenizer, prompt, policy: str, ratio: float, mode: str, quant: str | None = None, policy_options=()
) -> dict:
    """One trial: compress, ask, decode. Returns the measured fields of a result row."""
    device = model.device
    context_ids = prompt.context_ids.to(device)
    question_ids = prompt.question_ids.to(device)
    started = time.perf_counter()
    cache = KVWiseCache(
        model, policy=policy, compression_ratio=ratio, tokenizer=tokenizer, quant=quant, **dict(policy_options)
    )
    if mode == "agnostic":
        compressed_ids, rest_ids = context_ids, question_ids
    else:
        whole = torch.cat([context_ids, question_ids], dim=1)
        compressed_ids, rest_ids = whole[:, :-1], whole[:, -1:]
    cache.check_length(context_ids.shape[1] + question_ids.shape[1] + NUM_NEW_TOKENS)
    with torch.no_grad(), PeakMemory(device) as memory:
        cache.compress_context(compressed_ids)
        kv_bytes = cache.nbytes()
        new_ids = greedy_continue(model, cache, rest_ids, NUM_NEW_TOKENS)
    seconds = time.perf_counter() - started
    num_compressed = compressed_ids.shape[1]
    return {
        "kv_bytes": kv_bytes,
        "full_kv_bytes": full_kv_bytes(model, num_compressed, model.dtype.itemsize),
        "full16_kv_bytes": full_kv_bytes(model, num_compressed, 2),
        "compressed_tokens": num_compressed,
        "seconds": seconds,
        "peak_bytes": memory.peak_bytes,  # above what the process held before the trial
        "answer": tokenizer.decode(new_ids[0], skip_special_tokens=True),
    }


def bench_haystack(directory: str | None) -> str:
    """The user's haystack folder whole; else the built-in essays less those kept for calibration
    (what kvzap's surrogate and `kvwise calibrate` train on), so no trial reads a training text."""
    return read_haystack(directory) if directory is not None else split_essays()[0]


def _cell_settings(config: NiahConfig, runner, sizer: ByteSizer, prompt, name: str, ratio, budget):
    """What one cell runs on one trial's prompt: ((policy, ratio, quant, options), None), or
    (the same, why) when the path cannot run it. A budget cell solves its ratio from the prompt's
    length and the path's page size."""
    policy, options = policy_options(name) if budget is None else (name, ())
    quant = config.quant
    if budget is not None:
        mix = budget_mix(name)
        solved = sizer.solve(mix, prompt.context_ids.shape[1], budget, runner.page_tokens(mix.quant))
        if solved.ratio is None:
            return (policy, None, quant, options), solved.note
        policy, ratio, quant, options = mix.policy, round(solved.ratio, 6), mix.quant, mix.options
    return (policy, ratio, quant, options), runner.refuses(policy, ratio, quant, options)


def _kvpress_rows(config: NiahConfig, model, tokenizer, trial_prompts, out_dir: Path) -> tuple[list[dict], str | None]:
    """kvpress on the same trials (--compare), or no rows and why it could not run."""
    if not config.compare:
        return [], None
    try:
        rows = run_kvpress(
            model, tokenizer, trial_prompts, config.compare, config.ratios, config.mode, NUM_NEW_TOKENS, out_dir
        )
    except KvpressUnavailable as error:  # the kvwise rows stand; the table says why kvpress's are missing
        log.error("%s", error)
        return [], str(error)
    return rows, None


def run_niah(config: NiahConfig, out_dir: Path, resume: bool = True) -> dict:
    from kvwise.models import load_model

    model, tokenizer = load_model(config.model)
    builder = NeedlePromptBuilder(
        tokenizer, bench_haystack(config.haystack_dir), config.needle, config.question, config.answer_prefix
    )
    trials = trial_grid(config.lengths, config.depths, config.trials_per_depth, config.seed)
    prompts = {trial: builder.build(trial) for trial in trials}
    longest = max(p.context_ids.shape[1] + p.question_ids.shape[1] for p in prompts.values()) + NUM_NEW_TOKENS
    KVWiseCache(model).check_length(longest)  # fail before any trial runs, naming the maximum
    runners = {path: _trial_runner(path, model, tokenizer, longest) for path in config.paths}

    out_dir.mkdir(parents=True, exist_ok=True)
    partial_path = out_dir / "niah.partial.jsonl"
    done = _load_partial(partial_path, config) if resume else {}
    if not resume and partial_path.exists():
        partial_path.unlink()
    # trial by trial, every cell of a trial in turn: seconds per trial compare cells under the same
    # machine load (reported as medians), and an interrupted run has every cell's first trials
    cells = [(name, ratio, None) for name, ratio in config.cells()]
    cells += [(mix, None, budget) for mix, budget in config.budget_cells()]
    work = [(*cell, trial, path) for trial in trials for cell in cells for path in config.paths]
    sizer, skipped, order = ByteSizer(model), {}, []
    # Warm-up: the first forward pays one-time costs that would bias the first trial.
    for runner in runners.values():
        runner(prompts[trials[0]], "full", 0.0, config.mode)
    with partial_path.open("a") as partial, tqdm(total=len(work), desc="niah", unit="trial") as progress:
        if not done:
            partial.write(json.dumps({"config": asdict(config)}) + "\n")
        for name, ratio, budget, trial, path in work:
            progress.set_postfix(path=path, policy=name, ratio=ratio, budget=budget)
            progress.update()
            runner = runners[path]
            settings, why = _cell_settings(config, runner, sizer, prompts[trial], name, ratio, budget)
            policy, ratio, quant, options = settings
            if why:
                skipped[(name, budget, None if budget is not None else ratio, path)] = why
                continue
            key = row_key({"policy": name, "ratio": ratio, "budget": budget, "path": path, **_trial_fields(trial)})
            order.append(key)
            if key not in done:
                measured = runner(prompts[trial], policy, ratio, config.mode, quant, options)
                row = {
                    "policy": name,
                    "ratio": ratio,
                    "budget": budget,
                    **_trial_fields(trial),
                    "key": trial.key,
                    "mode": config.mode,
                    "quant": quant,
                    "path": path,
                    "engine": path == "engine",
                    "correct": str(trial.key) in measured["answer"],
                    **measured,
                }
                partial.write(json.dumps(row) + "\n")
                partial.flush()
                done[key] = row
    results = [done[key] for key in order]
    compare_rows, compare_error = _kvpress_rows(config, model, tokenizer, [(t, prompts[t]) for t in trials], out_dir)
    results += compare_rows
    report = {
        "workload": "niah",
        "config": asdict(config),
        "prompt_format": builder.prompt_format,
        "system": system_info(model.device),
        "results": results,
        "skipped": [
            {"mix": mix, "budget": budget, "ratio": ratio, "path": path, "why": why}
            for (mix, budget, ratio, path), why in skipped.items()
        ],
        "compare_error": compare_error,
    }
    (out_dir / "niah.json").write_text(json.dumps(report, indent=1))
    from kvwise.bench.niah_report import write_niah_report

    write_niah_report(report, out_dir)
    return report


def _load_partial(path: Path, config: NiahConfig) -> dict:
    """Rows of an earlier run with the same configuration, keyed by cell and trial."""

    def comparable(settings: dict) -> dict:
        ignored = ("policies", "ratios", "budget_bytes", "mixes")
        return {name: value for name, value in settings.items() if name not in ignored}

    return read_partial(
        path,
        lambda previous: comparable(previous) == comparable(asdict(config)),
        row_key,
    )


def row_key(row: dict) -> tuple:
    """A result row's path, cell and trial; equal-bytes rows are keyed by their budget, not the
    ratio it set."""
    cell = row["ratio"] if row.get("budget") is None else f"budget={row['budget']}"
    path = row.get("path", "engine" if row.get("engine") else "library")
    return (path, row["policy"], cell, row["length"], row["depth"], row["trial"])


def _trial_runner(path: str, model, tokenizer, longest: int):
    if path == "engine":
        from kvwise.bench.niah_engine import EngineTrials

        return EngineTrials(model, tokenizer, longest)
    return LibraryTrials(model, tokenizer)


class LibraryTrials:
    """Trials through the library's cache (`KVWiseCache`)."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    def page_tokens(self, quant: str | None) -> int:
        """A quantized mix keeps whole pages of its stored form (`fill_pages`), as the engine does,
        so a budget sets both paths the same ratio; unquantized, nothing pads a head's tokens."""
        return 1 if quant is None else StoredForm.of(make_quantizer(quant)).page_tokens()

    def refuses(self, policy, ratio, quant, options) -> str | None:
        return None

    def __call__(self, prompt, name, ratio, mode, quant=None, options=()) -> dict:
        return run_trial(self.model, self.tokenizer, prompt, name, ratio, mode, quant, options)


def _trial_fields(trial) -> dict:
    return {"length": trial.length, "depth": trial.depth, "trial": trial.trial}
