"""`kvwise calibrate`: train kvzap's score surrogate, measure each candidate mix on a model and
write its profile.

The surrogate (`adaptive.surrogate_training`) comes first: a few minutes of KVzip runs on the
calibration text, one small head per layer, written as `<fingerprint>.kvzap.safetensors` beside
the profile (kept when already there, unless `--no-resume`); then the low-rank codec's bases
(`adaptive.lowrank_training`, seconds), as `<fingerprint>.lowrank.safetensors`.

Each mix runs every probe (`adaptive.probes`) and the measurements become a `Profile`: quality per
class relative to `full` on the same probes, bytes per token, extra seconds per token, and the
Pareto front per class (a Markdown table and a plot beside the JSON). Every probe runs through
the serving engine, all of a mix's at once, as `auto` serves them: retrieval and long generation
by their greedy output, chat by the perplexity of a given continuation read after the compressed
prompt (the engine's prompt logprobs). `measure_probe` measures one probe through the library's
cache (`KVWiseCache`) the same way, for comparisons of the two paths. Rows stream to a partial
file, so an interrupted run resumes; `--budget-minutes` stops starting new mixes once spent.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import time
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path

import torch
from tqdm import tqdm

from kvwise._version import __version__
from kvwise.adaptive.cost_calibration import QUICK_COSTS, CostConfig, measure_costs
from kvwise.adaptive.lowrank_training import fit_basis
from kvwise.adaptive.probes import AGREEMENT_TOKENS, Probe, agreement, calibration_text, make_probes
from kvwise.adaptive.profile import CLASSES, MixProfile, Profile, Provenance, user_profile_path
from kvwise.adaptive.surrogate_training import SurrogateConfig, train_surrogate
from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.kv_settings import resolve
from kvwise.engine.sampling import SamplingParams
from kvwise.hf.cache import KVWiseCache, full_kv_bytes
from kvwise.hf.generation import greedy_continue
from kvwise.kv.lowrank_basis import SUFFIX as BASIS_SUFFIX
from kvwise.policies.mix import Mix, parse_mix
from kvwise.policies.score_surrogate import SUFFIX as SURROGATE_SUFFIX
from kvwise.util.fingerprint import weights_fingerprint
from kvwise.util.partial import read_partial
from kvwise.util.plotting import headless_pyplot

log = logging.getLogger("kvwise.calibrate")

# most useful first: a run cut short by --budget-minutes still covers the common choices
DEFAULT_MIXES = (
    "full",
    "kivi4",
    "snapkv@0.75",
    "kvzip@0.75",
    "snapkv@0.9",
    "kivi2",
    "snapkv@0.75+kivi4",
    "streaming_llm@0.75",
    "snapkv@0.5",
    "kvzip@0.9",
    "adakv@0.75",
    "adakv@0.9",
    "int8",
    "kvzip@0.75+kivi4",
    "snapkv@0.5+kivi4",
    "snapkv@0.9+kivi4",
    "pyramidkv@0.75",
    "streaming_llm@0.5",
    "h2o@0.75",
    "tova@0.75",
    "adakv@0.75+kivi4",
    "streaming_llm@0.5+kivi4",
    "kvzip@0.75+int8",
)
QUICK_MIXES = DEFAULT_MIXES[:8]
PROBES = {"retrieval": 10, "chat": 4, "long_generation": 4}
QUICK_PROBES = {"retrieval": 4, "chat": 3, "long_generation": 2}
RETRIEVAL_TOKENS = 8
ENGINE_CLASSES = ("retrieval", "chat", "long_generation")  # every class is measured in the engine


@dataclass
class CalibrateConfig:
    model: str | None = None
    data: str | None = None  # a folder of the user's documents (default: the built-in essays)
    mixes: tuple[str, ...] = DEFAULT_MIXES
    probes: dict | None = None
    budget_minutes: float | None = None
    seed: int = 0
    quick: bool = False
    probe_lengths: dict | None = None  # class -> (fewest, most) passage tokens (default probes.LENGTHS)
    # kvzap's score surrogate and the low-rank codec's bases: "train" (unless already there),
    # "skip", or "only" (no profile)
    surrogate: str = "train"
    costs: str = "measure"  # what actions cost on this machine: "measure", "skip", or "only" (into the profile there)
    cost_config: CostConfig | None = None  # the points timed (default: CostConfig(), QUICK_COSTS with quick)
    command: str | None = None  # as the user typed it, for the profile's provenance (default: this config)

    def __post_init__(self):
        if self.quick and self.mixes == DEFAULT_MIXES:
            self.mixes = QUICK_MIXES
        self.probes = dict(self.probes or (QUICK_PROBES if self.quick else PROBES))
        # as spelled (kivi4, not its canonical spec with every option), one per canonical spec; full
        # first, the reference of every quality; errors name the bad component
        by_spec = {"full": "full"}
        for mix in self.mixes:
            by_spec.setdefault(parse_mix(mix).spec, mix.strip())
        self.mixes = tuple(by_spec.values())
        if self.budget_minutes is not None and self.budget_minutes <= 0:
            raise ValueError(f"--budget-minutes must be positive, got {self.budget_minutes}")
        if self.surrogate not in ("train", "skip", "only"):
            raise ValueError(f"surrogate must be 'train', 'skip' or 'only', got {self.surrogate!r}")
        if self.costs not in ("measure", "skip", "only"):
            raise ValueError(f"costs must be 'measure', 'skip' or 'only', got {self.costs!r}")
        if self.cost_config is None:
            self.cost_config = QUICK_COSTS if self.quick else CostConfig()


def run_calibrate(config: CalibrateConfig, out: Path | None = None, resume: bool = True, model=None) -> Path:
    """Train kvzap's surrogate (`<fingerprint>.kvzap.safetensors`) and fit the low-rank bases
    (`<fingerprint>.lowrank.safetensors`), measure, write `<fingerprint>.json`
    (and .md, .png) under `out`; returns the JSON's path (the surrogate's with `surrogate="only"`)."""
    if model is None:
        from kvwise.models import load_model

        model, tokenizer = load_model(config.model)
    else:
        model, tokenizer = model
    fingerprint = weights_fingerprint(model)
    out = Path(out) if out is not None else user_profile_path(fingerprint).parent
    out.mkdir(parents=True, exist_ok=True)
    text, description = calibration_text(config.data)
    if config.costs == "only":
        return _measure_costs_into(out / f"{fingerprint}.json", model, tokenizer, text, config)
    surrogate_path = out / f"{fingerprint}{SURROGATE_SUFFIX}"
    if config.surrogate != "skip" and (config.surrogate == "only" or not resume or not surrogate_path.exists()):
        surrogate_config = SurrogateConfig(seed=config.seed)
        if config.quick:
            surrogate_config.passages, surrogate_config.held_out = 6, 1
        train_surrogate(model, tokenizer, text, description, surrogate_config).save(surrogate_path)
        log.info("kvzap surrogate written to %s", surrogate_path)
    basis_path = out / f"{fingerprint}{BASIS_SUFFIX}"
    if config.surrogate != "skip" and (config.surrogate == "only" or not resume or not basis_path.exists()):
        fit_basis(model, tokenizer, text, description, passages=3 if config.quick else 6).save(basis_path)
        log.info("low-rank bases written to %s", basis_path)
    if config.surrogate == "only":
        return surrogate_path
    probes = make_probes(tokenizer, text, config.probes, config.seed, config.probe_lengths)
    header = {
        "fingerprint": fingerprint,
        "probes": config.probes,
        "seed": config.seed,
        "data": description,
        "lengths": config.probe_lengths,
        "engine_classes": list(ENGINE_CLASSES),
    }
    header = json.loads(json.dumps(header))  # as it reads back (tuples become lists)
    partial = out / f"{fingerprint}.partial.jsonl"
    done = read_partial(partial, lambda saved: saved == header, lambda row: (row["mix"], row["probe"]))
    if not resume or not done:
        partial.write_text(json.dumps({"config": header}) + "\n")
        done = {}
    started, rows = time.monotonic(), dict(done)
    name = Path(getattr(model.config, "_name_or_path", None) or type(model).__name__).name
    with open(partial, "a") as sink, tqdm(total=len(config.mixes) * len(probes), desc="calibrate", unit="probe") as bar:
        for mix in config.mixes:
            if mix != "full" and config.budget_minutes and time.monotonic() - started > 60 * config.budget_minutes:
                log.warning("--budget-minutes spent: %s and the mixes after it are not measured", mix)
                break
            in_engine = [(i, p) for i, p in enumerate(probes) if p.klass in ENGINE_CLASSES and (mix, i) not in rows]
            measured = measure_in_engine(model, tokenizer, mix, in_engine) if in_engine else {}
            for index, probe in enumerate(probes):
                if (mix, index) not in rows:
                    outcome = measured.get(index) or measure_probe(model, tokenizer, parse_mix(mix), probe)
                    row = {"mix": mix, "probe": index, **outcome}
                    rows[(mix, index)] = row
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                bar.update(1)
    profile = build_profile(rows, probes, name, fingerprint, full_kv_bytes(model, 1, model.dtype.itemsize))
    profile.data = description
    profile.provenance = provenance(config, description, profile.probes, model)
    if config.costs == "measure":
        profile.costs = measure_costs(model, tokenizer, text, config.cost_config)
    path = profile.save(out / f"{fingerprint}.json")
    (out / f"{fingerprint}.md").write_text(markdown(profile))
    plot_fronts(profile, out / f"{fingerprint}.png")
    partial.unlink()
    return path


def _measure_costs_into(path: Path, model, tokenizer, text: str, config: CalibrateConfig) -> Path:
    """Measure the machine's costs into the profile at `path` (its mixes stay as they were)."""
    if not path.exists():
        raise ValueError(f"no profile at {path} to add machine costs to: run `kvwise calibrate` without --costs-only")
    profile = Profile.load(path)
    profile.costs = measure_costs(model, tokenizer, text, config.cost_config)
    profile.save(path)
    path.with_suffix(".md").write_text(markdown(profile))
    return path


def provenance(config: CalibrateConfig, data: str, probes: dict[str, int], model) -> Provenance:
    """What a reader needs to make the profile again, and to know what it was measured on."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        hardware = f"cuda: {torch.cuda.get_device_name(device)}"
    else:
        cpu = platform.processor() or platform.machine()
        hardware = f"cpu: {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
    command = config.command
    if command is None:  # called from Python: the call, with the settings that differ from the defaults
        changed = [
            f"{item.name}={getattr(config, item.name)!r}"
            for item in fields(config)
            if item.name not in ("probes", "mixes") and getattr(config, item.name) != item.default
        ]
        command = f"run_calibrate(CalibrateConfig({', '.join(changed)}))"
    return Provenance(
        kvwise=__version__,
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        command=command,
        seed=config.seed,
        data=data,
        probes=dict(probes),
        dtype=str(model.dtype).removeprefix("torch."),
        device=hardware,
        torch=torch.__version__,
    )


def measure_in_engine(model, tokenizer, mix: str, probes: list[tuple[int, Probe]]) -> dict[int, dict]:
    """Run `probes` [(index, probe)] under `mix` through one engine, all at once, as `auto` serves
    them; per index, the raw outcome and `bytes`: what the request held on its last step (its
    compressed region or quantized blocks, and the few tokens it generated; a chat probe's: once
    its prompt was compressed). The batch's seconds
    are shared out by prompt length.

    As in `measure_probe`, all but a probe's last prompt token are compressed (`compress_upto`).
    Retrieval and long generation decode greedily; a chat probe's continuation is read after its
    prompt and scored by its prompt logprobs, under the compressed context as the engine holds it."""
    block = CacheConfig.block_size
    # room for every prompt, its output and a KVzip pass over it (about as long again)
    longest = {index: probe.prompt_ids.shape[1] + _continuation_length(probe) for index, probe in probes}
    blocks = sum(3 * -(-(longest[index] + AGREEMENT_TOKENS) // block) for index, _ in probes) + 16
    core = EngineCore(model, tokenizer, CacheConfig(num_blocks=blocks, prefix_caching=False), [])
    settings = resolve(mix)
    compresses = settings is not None and ((settings.ratio > 0 and settings.evicts) or settings.quantizer is not None)
    requests = []
    for _, probe in probes:
        prompt = probe.prompt_ids[0].tolist()
        if probe.klass == "chat":
            params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
            tokens = prompt + probe.continuation_ids[0].tolist()
        else:
            wanted = RETRIEVAL_TOKENS if probe.klass == "retrieval" else AGREEMENT_TOKENS
            params, tokens = SamplingParams(temperature=0, max_tokens=wanted, ignore_eos=True), prompt
        upto = len(prompt) - 1 if compresses else None
        requests.append(core.make_request(tokens, params, kv=settings, compress_upto=upto))
    started, held = time.perf_counter(), {}
    for request in requests:
        core.add(request)
    while core.has_work:
        core.step()
        for request in requests:
            if request.done:
                continue
            if request.output or (request.prompt_logprobs is None and request.computed >= request.compression_point):
                held[request] = core.kv.request_bytes(request)
            elif request.prompt_logprobs is not None and _compressed(request):
                # a chat probe: what its compressed prompt holds, before the continuation is read
                held.setdefault(request, core.kv.request_bytes(request))
    seconds = time.perf_counter() - started
    prompt_tokens = sum(probe.prompt_ids.shape[1] for _, probe in probes)
    rows = {}
    for (index, probe), request in zip(probes, requests):
        if request.error is not None:
            raise RuntimeError(f"calibrating {mix}: the engine failed a {probe.klass} probe: {request.error}")
        length = probe.prompt_ids.shape[1]
        row = {"bytes": held.get(request, 0), "full_bytes": full_kv_bytes(model, length - 1, model.dtype.itemsize)}
        if probe.klass == "retrieval":
            row["correct"] = probe.answer in tokenizer.decode(request.output)
        elif probe.klass == "chat":
            scored = request.prompt_logprobs[length:]  # each continuation token given all before it
            row["nll"] = -sum(entry[token] for entry, token in zip(scored, request.prompt[length:])) / len(scored)
        else:
            row["tokens"] = list(request.output[:AGREEMENT_TOKENS])
        rows[index] = {**row, "seconds": seconds * length / prompt_tokens, "prompt_tokens": length}
    return rows


def _compressed(request) -> bool:
    """Its prompt's compression is done: the point is computed and any eviction (a KVzip pass
    included) has run."""
    settings = request.kv
    evicting = settings is not None and settings.evicts and settings.ratio > 0
    done = request.reconstruction is None and (request.region is not None or not evicting)
    return request.computed >= request.compression_point and done


def _continuation_length(probe: Probe) -> int:
    return probe.continuation_ids.shape[1] if probe.continuation_ids is not None else 0


@torch.no_grad()
def measure_probe(model, tokenizer, mix: Mix, probe: Probe) -> dict:
    """Run one probe under one mix through the library cache: bytes kept after compressing the
    prompt, seconds, and the raw outcome (the answer, the continuation's negative log-likelihood,
    the greedy tokens)."""
    device = model.device
    prompt = probe.prompt_ids.to(device)
    started = time.perf_counter()
    cache = KVWiseCache.for_mix(model, mix, tokenizer)
    cache.compress_context(prompt[:, :-1])  # the engine compresses once the prompt is computed
    row = {"bytes": cache.nbytes(), "full_bytes": full_kv_bytes(model, prompt.shape[1] - 1, model.dtype.itemsize)}
    if probe.klass == "retrieval":
        answer = tokenizer.decode(greedy_continue(model, cache, prompt[:, -1:], RETRIEVAL_TOKENS)[0])
        row["correct"] = probe.answer in answer
    elif probe.klass == "chat":
        continuation = probe.continuation_ids.to(device)
        inputs = torch.cat([prompt[:, -1:], continuation[:, :-1]], dim=1)
        log_probs = torch.log_softmax(model(input_ids=inputs, cache=cache, use_cache=True).logits[0].float(), -1)
        row["nll"] = -float(log_probs.gather(1, continuation[0, :, None]).mean())
    else:
        row["tokens"] = greedy_continue(model, cache, prompt[:, -1:], AGREEMENT_TOKENS)[0].tolist()
    row["seconds"] = time.perf_counter() - started
    row["prompt_tokens"] = prompt.shape[1]
    return row


def build_profile(rows: dict, probes: list[Probe], model: str, fingerprint: str, full_bytes_per_token: int) -> Profile:
    """Aggregate the rows of every mix measured on every probe into a Profile."""
    full = {index: rows[("full", index)] for index in range(len(probes))}
    full_seconds = sum(row["seconds"] for row in full.values())
    prompt_tokens = sum(row["prompt_tokens"] for row in full.values())
    full_bytes = sum(row["bytes"] for row in full.values())  # what the full cache held on the same probes
    mixes = []
    for mix in dict.fromkeys(key[0] for key in rows):
        measured = [rows.get((mix, index)) for index in range(len(probes))]
        if any(row is None for row in measured):
            continue  # cut short: a mix is measured on every probe or not at all
        quality, details = {}, {}
        for klass in CLASSES:
            indices = [index for index, probe in enumerate(probes) if probe.klass == klass]
            quality[klass], details[klass] = _class_quality(
                klass, [measured[i] for i in indices], [full[i] for i in indices]
            )
        mixes.append(
            MixProfile(
                mix=mix,
                bytes_fraction=round(sum(r["bytes"] for r in measured) / full_bytes, 4),
                extra_seconds_per_token=round(
                    max(0.0, sum(r["seconds"] for r in measured) - full_seconds) / prompt_tokens, 6
                ),
                quality=quality,
                details=details,
            )
        )
    counts = {klass: sum(probe.klass == klass for probe in probes) for klass in CLASSES}
    return Profile(model, fingerprint, full_bytes_per_token, mixes, probes=counts)


def _class_quality(klass: str, rows: list[dict], full: list[dict]) -> tuple[float, dict]:
    """Relative quality of one class in [0, 1] and its raw figures; 1.0 when the class has no probes."""
    if not rows:
        return 1.0, {"probes": 0}
    if klass == "retrieval":
        accuracy, reference = _mean(r["correct"] for r in rows), _mean(r["correct"] for r in full)
        quality = 1.0 if reference == 0 else min(1.0, accuracy / reference)
        return round(quality, 4), {"probes": len(rows), "accuracy": accuracy, "full_accuracy": reference}
    if klass == "chat":
        ratios = [min(1.0, math.exp(f["nll"] - r["nll"])) for r, f in zip(rows, full)]  # full ppl / this ppl
        ppl = math.exp(_mean(r["nll"] for r in rows))
        return round(_mean(ratios), 4), {
            "probes": len(rows),
            "ppl": round(ppl, 3),
            "ppl_ratio": round(_mean(ratios), 4),
        }
    agreed = _mean(agreement(r["tokens"], f["tokens"]) for r, f in zip(rows, full))
    return round(agreed, 4), {"probes": len(rows), "agreement": round(agreed, 4)}


def _mean(values) -> float:
    values = [float(value) for value in values]
    return sum(values) / len(values) if values else 0.0


def markdown(profile: Profile) -> str:
    lines = [
        f"Calibration profile of {profile.model} (weights {profile.fingerprint}), probes from {profile.data}: "
        + ", ".join(f"{count} {klass}" for klass, count in profile.probes.items()),
        "",
    ]
    made = profile.provenance
    if made is not None:
        lines += [
            f"Made by `{made.command}` (seed {made.seed}) with kvwise {made.kvwise} on {made.date}; "
            f"{made.dtype} on {made.device}, torch {made.torch}.",
            "",
        ]
    lines += [
        "| mix | bytes vs full | extra s/token | " + " | ".join(CLASSES) + " | on the front of |",
        "|---|---|---|" + "---|" * len(CLASSES) + "---|",
    ]
    fronts = {klass: {entry.mix for entry in profile.front(klass)} for klass in CLASSES}
    for entry in sorted(profile.mixes, key=lambda e: e.bytes_fraction):
        quality = " | ".join(f"{entry.quality[klass]:.3f}" for klass in CLASSES)
        on = ", ".join(klass for klass in CLASSES if entry.mix in fronts[klass]) or "-"
        lines.append(
            f"| {entry.mix} | {entry.bytes_fraction:.3f} | {entry.extra_seconds_per_token:.5f} | {quality} | {on} |"
        )
    costs = profile.costs
    if costs is not None:
        lines += [
            "",
            f"Machine costs ({costs.machine}, {costs.dtype}): a decode step takes {1000 * costs.base:.1f} ms, plus "
            f"per request in each form; a context pass {1000 * costs.prefill_seconds_per_token:.3f} ms per token.",
            "",
            "| form | ms per request | ms per MB held |",
            "|---|---|---|",
        ]
        for name, cost in costs.forms.items():
            lines.append(f"| {name} | {1000 * cost.per_request:.2f} | {1000 * cost.per_byte * 2**20:.3f} |")
    return "\n".join(lines) + "\n"


def plot_fronts(profile: Profile, path: Path) -> None:
    """Quality against bytes per class, the front joined by a line."""
    plt = headless_pyplot("plot of the profile")
    if plt is None:
        return
    figure, axes = plt.subplots(1, len(CLASSES), figsize=(5 * len(CLASSES), 4), sharey=True)
    for axis, klass in zip(axes, CLASSES):
        axis.scatter(
            [e.bytes_fraction for e in profile.mixes], [e.quality[klass] for e in profile.mixes], s=14, c="grey"
        )
        front = profile.front(klass)
        axis.plot([e.bytes_fraction for e in front], [e.quality[klass] for e in front], "o-", color="tab:blue")
        for entry in front:
            axis.annotate(entry.mix, (entry.bytes_fraction, entry.quality[klass]), fontsize=7, rotation=20)
        axis.set_title(klass)
        axis.set_xlabel("KV bytes / full")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("quality vs full")
    figure.suptitle(f"{profile.model}: the Pareto front per class")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
