"""Measure what the controller's actions cost on this machine (`costs.MachineCosts`).

Decode steps are timed in the engine itself, the way the server runs them: `batch` requests of
`length` prompt tokens (consecutive slices of the calibration text), prefix caching off, every
request in one KV form, then `steps` decode steps of all of them (median). From

    full at batch 1 and at batch B, both at the shorter length, and
    each form at batch B at both lengths,

the step line is solved: the per-byte cost of a form from its two lengths, the per-request cost of
`full` from its two batch sizes, the base as what is left of the single request's step, and every
other form's per-request cost as what is left of its step at the shorter length. Each is clamped
at zero, where a noisy machine would make one negative. The prefill of `full` at the longer
length gives the seconds per token of a context pass.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from kvwise.adaptive.costs import FormCost, MachineCosts
from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.sampling import SamplingParams
from kvwise.util.machine import machine_line

# the cost model's forms, each as the engine mix that holds a request's KV that way
FORM_MIXES = {"full": "full", "evicted": "snapkv@0.5", "int8": "int8", "kivi4": "kivi4", "kivi2": "kivi2"}
QUICK_FORMS = ("full", "evicted", "int8", "kivi4")


@dataclass(frozen=True)
class CostConfig:
    lengths: tuple[int, int] = (512, 2048)
    batch: int = 4
    steps: int = 16  # timed decode steps per point
    warmup: int = 2
    forms: tuple[str, ...] = tuple(FORM_MIXES)

    def __post_init__(self):
        if len(self.lengths) != 2 or not 0 < self.lengths[0] < self.lengths[1]:
            raise ValueError(f"cost lengths are two increasing token counts, got {self.lengths}")
        if self.batch < 2 or self.steps < 1 or self.warmup < 0:
            raise ValueError("the cost batch must be >= 2 and steps >= 1")
        unknown = [form for form in self.forms if form not in FORM_MIXES]
        if unknown or "full" not in self.forms:
            raise ValueError(f"cost forms must include full and come from {', '.join(FORM_MIXES)}; got {unknown}")


QUICK_COSTS = CostConfig(lengths=(256, 1024), batch=3, steps=6, forms=QUICK_FORMS)


@dataclass(frozen=True)
class Point:
    step_seconds: float
    held_bytes: int  # KV bytes the requests held during the timed steps
    prefill_seconds: float
    prompt_tokens: int


def measure_costs(model, tokenizer, text: str, config: CostConfig = CostConfig()) -> MachineCosts:
    """Time the points and solve the step line (module docstring)."""
    stream = tokenizer(text, add_special_tokens=False).input_ids
    short, long = config.lengths
    plan = [("full", 1, short)] + [(form, config.batch, length) for form in config.forms for length in (short, long)]
    points = {}
    for form, batch, length in tqdm(plan, desc="machine costs", unit="point"):
        points[form, batch, length] = measure_point(model, _prompts(stream, length, batch), FORM_MIXES[form], config)
    one = points["full", 1, short]
    full_short, full_long = points["full", config.batch, short], points["full", config.batch, long]
    full_per_byte = _slope(full_short, full_long)
    full_per_request = max(
        0.0,
        (full_short.step_seconds - one.step_seconds - full_per_byte * (full_short.held_bytes - one.held_bytes))
        / (config.batch - 1),
    )
    base = max(0.0, one.step_seconds - full_per_request - full_per_byte * one.held_bytes)
    forms = {"full": FormCost(full_per_request, full_per_byte)}
    for form in config.forms:
        if form == "full":
            continue
        at_short, at_long = points[form, config.batch, short], points[form, config.batch, long]
        per_byte = _slope(at_short, at_long)
        per_request = max(0.0, (at_short.step_seconds - base - per_byte * at_short.held_bytes) / config.batch)
        forms[form] = FormCost(per_request, per_byte)
    return MachineCosts(
        machine=machine_line(model.device),
        dtype=str(model.dtype).removeprefix("torch."),
        base=base,
        forms=forms,
        prefill_seconds_per_token=full_long.prefill_seconds / full_long.prompt_tokens,
    )


def measure_point(model, prompts: list[list[int]], mix: str, config: CostConfig) -> Point:
    """Prefill `prompts` with `mix` on each, then time decode steps of all of them."""
    new_tokens = len(prompts) + config.warmup + config.steps + 4  # none ends before the last timed step
    block = CacheConfig.block_size
    blocks = len(prompts) * -(-(max(map(len, prompts)) + new_tokens) // block) + 16
    cache = CacheConfig(num_blocks=blocks, prefix_caching=False, max_running=len(prompts), swap_space_bytes=0)
    engine = EngineCore(model, None, cache)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    kv = None if mix == "full" else mix
    requests = [engine.make_request(prompt, params, index, kv=kv) for index, prompt in enumerate(prompts)]
    for request in requests:
        engine.add(request)
    started = _now(model.device)
    while not all(request.output for request in requests):  # prefill, and each request's first token
        engine.step()
    prefill_seconds = _now(model.device) - started
    for _ in range(config.warmup):
        engine.step()
    seconds = []
    for _ in range(config.steps):
        started = _now(model.device)
        engine.step()
        seconds.append(_now(model.device) - started)
    held = sum(engine.kv.request_bytes(request) for request in requests)
    for request in requests:
        engine.abort(request)
    return Point(statistics.median(seconds), held, prefill_seconds, sum(map(len, prompts)))


def _slope(short: Point, long: Point) -> float:
    """Seconds per held byte between two points of one form and batch."""
    grown = long.held_bytes - short.held_bytes
    return max(0.0, (long.step_seconds - short.step_seconds) / grown) if grown > 0 else 0.0


def _prompts(stream: list[int], length: int, batch: int) -> list[list[int]]:
    need = length * batch
    stream = (stream * (need // len(stream) + 1))[:need]
    return [stream[index * length : (index + 1) * length] for index in range(batch)]


def _now(device: torch.device) -> float:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
