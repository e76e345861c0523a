"""`kvwise bench decode`: what one decode step costs, across context length, batch, dtype and KV form.

For each point, `batch` requests of `length` prompt tokens (consecutive slices of the essays, raw
token ids) are prefilled in the engine with the KV form on every request, prefix caching off;
then every running request decodes one token per step. After `warmup` steps, `steps` steps are
timed: the whole step (scheduling, forward, sampling) and, inside it, the attention calls (the
paged attention function of every layer, including the write of the new token's KV and any read
of quantized blocks). Medians are reported.

Bytes per step: the weights (read once a step) and the KV the running requests hold (pool
blocks, quantized blocks, head pages), which a kernel reading the KV where it lies would read
once a step. The machine's memory bandwidth is a `copy_` of `bandwidth_bytes` in the same run;
the attention's bytes/s is the KV bytes over the attention time.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvwise.bench.haystack import read_haystack
from kvwise.bench.report_files import model_label, new_report, system_line, write_report
from kvwise.bench.reuse import plain_copy_seconds, synchronize

FORMS = ("full", "int8", "kivi4", "kivi2", "snapkv@0.9", "quest@0.9")


@dataclass
class DecodeConfig:
    lengths: tuple[int, ...] = (1000, 2000, 4000, 6000, 7500)
    batches: tuple[int, ...] = (1, 8)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    forms: tuple[str, ...] = FORMS
    steps: int = 16  # timed decode steps per point
    warmup: int = 3  # decode steps before the timed ones
    model: str | None = None
    bandwidth_bytes: int = 256 << 20  # the copy that measures memory bandwidth: well above the caches

    def __post_init__(self):
        from kvwise.engine.kv_settings import resolve

        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps must be >= 1 and warmup >= 0, got {self.steps} and {self.warmup}")
        if not self.lengths or min(self.lengths) < 2 or not self.batches or min(self.batches) < 1:
            raise ValueError(f"lengths must be >= 2 and batches >= 1, got {self.lengths} and {self.batches}")
        for dtype in self.dtypes:
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}; e.g. float32, bfloat16, float16")
        if "full" not in self.forms:
            raise ValueError("forms must include full: every other form is reported against it")
        for form in self.forms:
            resolve(form)  # a clear error for a bad form before any model loads


def memory_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes per second of the fastest of `repeats` copies of `nbytes` (each byte read once and
    written once; bytes copied over seconds, as a copy benchmark reports it)."""
    return nbytes / plain_copy_seconds(nbytes, repeats, device)


class AttentionClock:
    """Seconds spent in the engine's attention function while `timing()` is open."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, 0.0

    @contextlib.contextmanager
    def timing(self):
        from transformers import AttentionInterface

        from kvwise.engine.runner import ATTENTION_NAME, paged_attention, register_paged_attention

        def timed(*args, **kwargs):
            synchronize(self.device)
            started = time.perf_counter()
            output = paged_attention(*args, **kwargs)
            synchronize(self.device)
            self.seconds += time.perf_counter() - started
            return output

        AttentionInterface.register(ATTENTION_NAME, timed)  # models look the function up at each call
        try:
            yield self
        finally:
            register_paged_attention()


def prompts_for(tokenizer, length: int, batch: int) -> list[list[int]]:
    """`batch` prompts of `length` tokens: consecutive slices of the essays (wrapping around)."""
    stream = tokenizer(read_haystack(), add_special_tokens=False).input_ids
    need = length * batch
    stream = (stream * (need // len(stream) + 1))[:need]
    return [stream[index * length : (index + 1) * length] for index in range(batch)]


def measure_point(model, tokenizer, prompts: list[list[int]], form: str, config: DecodeConfig) -> dict:
    """Prefill `prompts` with `form` on each, then time `config.steps` decode steps of all of them."""
    from kvwise.engine.config import CacheConfig
    from kvwise.engine.core import EngineCore
    from kvwise.engine.sampling import SamplingParams

    # the first requests to finish their prefill decode while the others still prefill: enough
    # new tokens that none ends before the last timed step (all are aborted after it)
    token_budget = CacheConfig.token_budget
    prefill_steps = -(-sum(map(len, prompts)) // token_budget) + len(prompts)
    new_tokens = prefill_steps + config.warmup + config.steps + 2
    block = CacheConfig.block_size
    blocks = len(prompts) * -(-(max(map(len, prompts)) + new_tokens) // block) + 16
    cache = CacheConfig(num_blocks=blocks, prefix_caching=False, max_running=len(prompts), swap_space_bytes=0)
    engine = EngineCore(model, tokenizer, cache)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    requests = [engine.make_request(prompt, params, index, kv=form) for index, prompt in enumerate(prompts)]
    for request in requests:
        engine.add(request)
    while not all(request.output for request in requests):  # prefill, and each request's first token
        engine.step()
    for _ in range(config.warmup):
        engine.step()
    clock, device = AttentionClock(model.device), model.device
    step_seconds, attention_seconds = [], []
    with clock.timing():
        for _ in range(config.steps):
            clock.seconds = 0.0
            synchronize(device)
            started = time.perf_counter()
            engine.step()
            synchronize(device)
            step_seconds.append(time.perf_counter() - started)
            attention_seconds.append(clock.seconds)
            chunks = engine.step_log[-1].chunks
            if len(chunks) != len(prompts) or any(end - start != 1 for _, _, start, end in chunks):
                raise RuntimeError(f"a timed step was not one decode token per request: {chunks}")
    stats = engine.kv.stats()
    # blocks cut into head pages count as used blocks; what is read of them is the pages in use
    blocks = stats.used_blocks - stats.head_page_blocks
    kv_bytes = blocks * stats.block_bytes + stats.head_page_bytes + stats.quantized_bytes
    for request in requests:
        engine.abort(request)
    return {
        "form": form,
        "step_s": statistics.median(step_seconds),
        "attention_s": statistics.median(attention_seconds),
        "kv_bytes": kv_bytes,
    }


def weight_bytes(model) -> int:
    """Bytes of the model's parameters, each tensor once (tied embeddings are one tensor)."""
    seen = {parameter.data_ptr(): parameter.nbytes for parameter in model.parameters()}
    return sum(seen.values())


def run_decode(config: DecodeConfig, out_dir: Path) -> dict:
    from kvwise.models import load_model

    points = len(config.dtypes) * len(config.lengths) * len(config.batches) * len(config.forms)
    results, bandwidth, device = [], None, None
    with tqdm(total=points, desc="decode", unit="point") as progress:
        for dtype in config.dtypes:
            model, tokenizer = load_model(config.model, dtype=dtype)
            device = model.device
            bandwidth = bandwidth or memory_bandwidth(device, config.bandwidth_bytes)
            weights = weight_bytes(model)
            for length in config.lengths:
                for batch in config.batches:
                    prompts = prompts_for(tokenizer, length, batch)
                    rows = []
                    for form in config.forms:
                        progress.set_postfix_str(f"{dtype} L={length} batch={batch} {form}")
                        rows.append(measure_point(model, tokenizer, prompts, form, config))
                        progress.update()
                    results += _against_full(rows, dtype, length, batch, weights, bandwidth)
    report = new_report("decode", config, device, bandwidth_bytes_per_s=bandwidth, results=results)
    return write_report(out_dir, report, markdown, {"decode.png": plot_decode})


def _against_full(rows: list[dict], dtype: str, length: int, batch: int, weights: int, bandwidth: float) -> list:
    full = next(row for row in rows if row["form"] == "full")
    for row in rows:
        row.update(dtype=dtype, length=length, batch=batch, weight_bytes=weights)
        row["step_vs_full"] = row["step_s"] / full["step_s"]
        row["attention_vs_full"] = row["attention_s"] / full["attention_s"]
        row["attention_bytes_per_s"] = row["kv_bytes"] / row["attention_s"]
        row["attention_share_of_copy"] = row["attention_bytes_per_s"] / bandwidth
        row["step_bytes_per_s"] = (row["kv_bytes"] + weights) / row["step_s"]
    return rows


def markdown(report: dict) -> str:
    config = report["config"]
    lines = [
        f"Decode step, {config['steps']} timed steps after {config['warmup']} (medians), one new token per "
        f"request per step, prefix caching off, model={model_label(config)}",
        system_line(report["system"], "torch"),
        f"memory bandwidth (a {config['bandwidth_bytes'] >> 20} MiB copy, same run): "
        f"{report['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s",
        "",
        "x = against `full` at the same point; KV = bytes the running requests hold (read once a step by a kernel "
        "that reads them where they lie); attention GB/s = KV bytes / attention time, and its share of the copy "
        "bandwidth.",
        "",
        "| dtype | length | batch | form | step (ms) | x | attention (ms) | x | KV MB | attention GB/s | of copy |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        lines.append(
            f"| {row['dtype']} | {row['length']} | {row['batch']} | {row['form']} | {row['step_s'] * 1e3:.1f} | "
            f"{row['step_vs_full']:.2f}x | {row['attention_s'] * 1e3:.1f} | {row['attention_vs_full']:.2f}x | "
            f"{row['kv_bytes'] / 1e6:.1f} | {row['attention_bytes_per_s'] / 1e9:.1f} | "
            f"{row['attention_share_of_copy']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def plot_decode(report: dict, path: Path) -> None:
    from kvwise.util.plotting import headless_pyplot

    plt = headless_pyplot("decode plot")
    if plt is None:
        return
    results = report["results"]
    panels = sorted({(row["dtype"], row["batch"]) for row in results})
    figure, axes = plt.subplots(2, len(panels), figsize=(4.5 * len(panels), 7), squeeze=False)
    for column, (dtype, batch) in enumerate(panels):
        for form in report["config"]["forms"]:
            rows = [r for r in results if (r["dtype"], r["batch"], r["form"]) == (dtype, batch, form)]
            lengths = [row["length"] for row in rows]
            axes[0][column].plot(lengths, [row["step_s"] * 1e3 for row in rows], marker="o", label=form)
            axes[1][column].plot(lengths, [row["attention_s"] * 1e3 for row in rows], marker="o", label=form)
        axes[0][column].set_title(f"{dtype}, batch {batch}")
        axes[0][column].set_ylabel("decode step (ms)")
        axes[1][column].set_ylabel("attention per step (ms)")
        axes[1][column].set_xlabel("context tokens")
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
