"""`kvwise bench adaptive`: the adaptive controller against fixed techniques under one KV budget.

Each system serves the same workload through the engine, with all its KV memory (pool, host swap,
quantized blocks) limited by one budget. Workloads (`--workload`, `WORKLOADS`):
- `mixed` (`adaptive_workload`): four request classes arriving open-loop;
- `long-chat` (`long_chat`): conversations whose history grows turn by turn to 4-7K tokens, each
  turn sent when the last one finishes (closed loop);
- `doc-store` (`doc_store`): questions over a store of documents with Zipf popularity, from a few
  users at once (closed loop); each request's document may be compressed once and reused.
A budget of f "of peak demand" gives the pool f of the full cache's peak at unlimited memory (the
budget is that over the pool's share): at 1.0 `full` never waits for memory. In `doc-store` a
budget of f is f of the full KV of the documents its requests ask about, over the pool and a host
tier together, and every system gets that host tier: the pool keeps room for the requests running at once
(`DOC_STORE_POOL_REQUESTS`), the tier the rest.

Quality is scored per request against the full cache at unlimited memory:
- retrieval: the share of answers holding their key, over the full cache's on the same requests
  (capped at 1 for the class, so a system as accurate as the full cache scores 1);
- chat, short and long generation, long chat: min(1, full's perplexity / this one's) on the full
  cache's whole reply, both scored in the engine (`engine_scoring`) under the mixes the request
  held, each from the token it got it at (a request `auto` quantized or capped mid-run is replayed
  with the same changes at the same token counts);
- doc store: as retrieval, the share of answers holding their document's key, over full's.

The rate, unless given, is twice the full cache's service rate at unlimited memory, measured on a
burst of the same requests: it saturates `full` at every budget, so output tokens per second measure
what each system can serve, not how fast requests arrive.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from kvwise.bench.adaptive_workload import WorkloadRequest, WorkloadSpec, at_rate
from kvwise.bench.doc_store import CLASS as DOC_STORE
from kvwise.bench.doc_store import DocStoreSpec, document_bytes
from kvwise.bench.long_chat import LongChatSpec
from kvwise.bench.report_files import model_label, new_report, system_line, write_report
from kvwise.bench.stats import percentile
from kvwise.engine.config import CacheConfig
from kvwise.engine.kv_actions import KVChange
from kvwise.engine.kv_budget import POOL_SHARE, SWAP_SHARE, cache_config_for_budget, token_bytes
from kvwise.engine.kv_settings import KVSettings
from kvwise.engine.sampling import SamplingParams
from kvwise.policies.mix import parse_mix
from kvwise.util.partial import read_partial
from kvwise.util.plotting import headless_pyplot

FIXED = ("snapkv@0.75", "streaming_llm@0.75", "kvzip@0.9", "kivi4", "kivi2", "kvzip@0.75+kivi4")
SYSTEMS = ("full", *FIXED, "host-spill", "static", "auto")
STATIC_TABLE = {"chat": "h2o@0.5", "long_generation": "streaming_llm@0.5", "short": "full"}  # + retrieval: profile's
SATURATION = 2.0  # the default rate over full's service rate: arrivals outpace it at every budget
PARTIAL_FORMAT = 3  # rows log each request's plan (the mixes it held, from which token)
CLASS_LABELS = {"long_generation": "long gen", "long_chat": "long chat", "doc_store": "doc store"}
# --workload: its spec, which builds its requests and names its tier layout (`tier_layout`, if any)
WORKLOADS = {"mixed": WorkloadSpec, "long-chat": LongChatSpec, "doc-store": DocStoreSpec}
DOC_STORE_POOL_REQUESTS = 1  # pool room, in longest requests, beyond one per client (a KVzip pass borrows one)
MEMORY_BOUND = 0.7  # a workload is memory-bound at a budget where full runs at most this of full unlimited
UNLIMITED_BYTES = 6 << 30  # the reference's pool: never full on these workloads (its preemptions are reported)


@dataclass
class AdaptiveBenchConfig:
    workload: WorkloadSpec | LongChatSpec | DocStoreSpec = field(default_factory=WorkloadSpec)
    systems: tuple[str, ...] = SYSTEMS
    budgets: tuple[float, ...] = (0.3, 1.0)
    rate: float | None = None  # requests per second; None: SATURATION x full's burst rate, unlimited memory
    repeats: int = 1
    quality: float = 0.98  # auto's floor
    profile: str | None = None  # a profile JSON (default: the model's, by fingerprint)
    model: str | None = None

    def __post_init__(self):
        unknown = [name for name in self.systems if name not in SYSTEMS and not _is_mix(name)]
        if unknown:
            raise ValueError(
                f"unknown systems {unknown}; choose from: {', '.join(SYSTEMS)}, or any KV mix (kvzip@0.75+int8)"
            )
        if any(not 0 < budget <= 4 for budget in self.budgets):
            raise ValueError("--budgets are fractions of peak demand in (0, 4]")
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")


def run_adaptive_bench(config: AdaptiveBenchConfig, out_dir: Path, resume: bool = True) -> dict:
    from kvwise.adaptive.profile import require_profile
    from kvwise.models import load_model

    model, tokenizer = load_model(config.model)
    profile = require_profile(model, config.profile)
    requests = config.workload.build(tokenizer)
    closed_loop = any(request.follows is not None for request in requests)
    out_dir.mkdir(parents=True, exist_ok=True)
    header = {key: value for key, value in asdict(config).items() if key not in ("systems", "budgets", "repeats")}
    header["format"] = PARTIAL_FORMAT  # rows of an older budget meaning are not reused
    header["workload_name"] = workload_name(config.workload)
    header = json.loads(json.dumps(header))  # as it reads back (tuples become lists)
    partial = out_dir / "adaptive.partial.jsonl"
    done = read_partial(partial, lambda saved: saved == header, lambda row: row["key"])
    if not resume or not done:
        partial.write_text(json.dumps({"config": header}) + "\n")
        done = {}
    runs = 2 + len(config.systems) * len(config.budgets) * config.repeats
    bench = _Bench(model, tokenizer, profile, requests, config)
    for fraction in config.budgets if bench.documents_bytes is not None else ():
        bench.doc_store_layout(bench.doc_store_budget(fraction))  # too small for the pool: fail now
    with open(partial, "a") as sink, tqdm(total=runs * len(requests), desc="adaptive", unit="request") as bar:

        def measured(key: str, run):
            if key not in done:
                done[key] = {"key": key, **run(bar)}
                sink.write(json.dumps(done[key]) + "\n")
                sink.flush()
            else:
                bar.update(len(requests))
            return done[key]

        rate = config.rate
        if closed_loop:  # each turn is sent when the last one ends: the rate is the engine's own
            rate, arrivals = 0.0, [request.arrival for request in requests]
            bar.total -= len(requests)
        else:
            if rate is None:
                burst = measured("burst", lambda bar: bench.run("full", None, at_rate(requests, None), bar))
                rate = SATURATION * len(requests) / burst["wall_seconds"]
            arrivals = at_rate(requests, rate)
        reference = measured(f"reference@{rate:.4f}", lambda bar: bench.run("full", None, arrivals, bar))
        peak = reference["peak_kv_bytes"]
        rows = []
        for fraction in config.budgets:
            if bench.documents_bytes is not None:
                budget = bench.doc_store_budget(fraction)
            else:  # rounded up, a block over: at 1.0 the pool holds full's peak whatever the rounding
                budget = max(math.ceil((fraction * peak + bench.block_bytes) / POOL_SHARE), bench.least_budget())
            for system in config.systems:
                for repeat in range(config.repeats):
                    key = f"{system}@{fraction}#{repeat}@{rate:.4f}"
                    row = measured(key, lambda bar, s=system, b=budget: bench.run(s, b, arrivals, bar))
                    rows.append({**row, "system": system, "budget": fraction, "repeat": repeat})
    scored = bench.score(rows, reference)
    report = new_report(
        "adaptive",
        config,
        model.device,
        workload_name=workload_name(config.workload),
        dtype=str(model.dtype).removeprefix("torch."),
        rate=rate,
        rate_source="closed loop"
        if closed_loop
        else "given"
        if config.rate is not None
        else f"{SATURATION:g}x full's service rate at unlimited memory (a burst)",
        pool_share=POOL_SHARE,
        peak_demand_bytes=peak,
        documents_bytes=bench.documents_bytes,
        reference=_summary(reference),
        profile=profile.fingerprint,
        results=scored,
    )
    write_report(out_dir, report, markdown, {"adaptive.png": plot})
    # the runs stay in the partial file: a later call with more systems, budgets or repeats reuses them
    return report


class _Bench:
    def __init__(self, model, tokenizer, profile, requests: list[WorkloadRequest], config: AdaptiveBenchConfig):
        self.model, self.tokenizer, self.profile, self.requests, self.config = (
            model,
            tokenizer,
            profile,
            requests,
            config,
        )
        self.token_bytes = token_bytes(model)
        self.block_bytes = self.token_bytes * CacheConfig.block_size
        self.longest = max(len(r.prompt) + r.max_tokens for r in requests)
        doc_store = isinstance(config.workload, DocStoreSpec)
        self.documents_bytes = document_bytes(requests, self.token_bytes) if doc_store else None
        self._replayed: dict[tuple[int, tuple], float] = {}  # (request, plan) -> NLL of full's reply

    def doc_store_budget(self, fraction: float) -> int:
        """A doc-store budget: `fraction` of the asked documents' full KV, pool and host tier together."""
        return round(fraction * self.documents_bytes)

    def doc_store_layout(self, budget: int) -> tuple[CacheConfig, int]:
        """A doc-store budget split: the pool holds one longest request per client and
        `DOC_STORE_POOL_REQUESTS` more; the host tier gets the rest."""
        requests = self.config.workload.clients + DOC_STORE_POOL_REQUESTS
        block = CacheConfig.block_size
        pool_bytes = requests * -(-self.longest // block) * self.block_bytes
        if pool_bytes >= budget:
            raise ValueError(
                f"a doc-store budget of {budget:,} bytes leaves no host tier beside a pool for {requests} requests "
                f"of {self.longest} tokens ({pool_bytes:,} bytes): raise --budgets or lower --clients"
            )
        cache = cache_config_for_budget(
            self.model, budget, CacheConfig(), self.longest, pool_share=pool_bytes / budget, swap_bytes=0
        )
        return cache, budget - cache.num_blocks * self.block_bytes

    def least_budget(self) -> int:
        """The smallest budget whose pool holds the longest request."""
        block = CacheConfig.block_size
        return math.ceil(-(-self.longest // block) * block * self.token_bytes / POOL_SHARE) + 1

    # ---- one run -------------------------------------------------------------------------------
    def run(self, system: str, budget: int | None, arrivals: list[float], bar) -> dict:
        from kvwise.engine.core import EngineCore
        from kvwise.tiers.host import HostTier

        tiers = []
        if budget is None:
            cache = CacheConfig(num_blocks=UNLIMITED_BYTES // (self.token_bytes * CacheConfig.block_size))
        elif self.documents_bytes is not None:
            cache, host_bytes = self.doc_store_layout(budget)
            if self.config.workload.tier_layout == "host":  # the workload's tiers: the same for every system
                tiers = [HostTier(host_bytes)]
        else:
            cache = cache_config_for_budget(self.model, budget, CacheConfig(), self.longest)
            if system == "host-spill":
                tiers = [HostTier(int(budget * (1 - POOL_SHARE - SWAP_SHARE)))]
        core = EngineCore(self.model, self.tokenizer, cache, tiers)
        if system == "auto":
            from kvwise.adaptive.controller import AdaptiveConfig, AdaptiveController

            core.attach_controller(AdaptiveController(self.profile, AdaptiveConfig(self.config.quality)))
        engine_requests = [self._request(core, system, request) for request in self.requests]
        started, peak = self._drive(core, engine_requests, arrivals, bar, self.requests)
        finished = max(r.finish_time or time.monotonic() for r in engine_requests)
        outputs = sum(len(r.output) for r in engine_requests)
        ttfts = [r.first_token_time - r.arrival for r in engine_requests if r.first_token_time is not None]
        controller = core.controller
        return {
            "budget_bytes": budget,
            "num_blocks": cache.num_blocks,
            "wall_seconds": finished - started,
            "output_tokens": outputs,
            "tokens_per_second": outputs / (finished - started),
            "ttft_p50_s": percentile(ttfts, 0.5),
            "ttft_p99_s": percentile(ttfts, 0.99),
            "preemptions": core.scheduler.preemptions,
            "failed": sum(r.error is not None for r in engine_requests),
            "peak_kv_bytes": peak,
            "actions": {f"{a}:{r}": n for (a, r), n in controller.decisions.counts.items()} if controller else {},
            "freed_bytes": dict(controller.decisions.bytes_freed) if controller else {},
            "action_log": list(controller.decisions.log) if controller else [],
            "requests": [
                {
                    "reply": list(r.output) if w.answer is None else None,
                    "plan": _plan(r),
                    "compress_upto": r.compress_upto,
                    "answer": self.tokenizer.decode(r.output) if w.answer is not None else None,
                    "document_hit": _document_hit(r, w),
                    "settings": _settings_spec(r.kv),
                    "choice": r.kv_choice.mix if r.kv_choice is not None else None,
                }
                for r, w in zip(engine_requests, self.requests)
            ],
        }

    def _request(self, core, system: str, request: WorkloadRequest):
        params = SamplingParams(temperature=0, max_tokens=request.max_tokens, ignore_eos=True)
        mix = None
        if system in FIXED or system not in SYSTEMS:  # a named fixed mix, or any mix spec
            mix = system
        elif system == "static":
            mix = STATIC_TABLE.get(request.klass) or self.static_retrieval()
        kv = mix if mix != "full" else None
        # a document is compressed once (and reused) by a system whose mix evicts, or by auto's choice
        compresses = system == "auto" or (kv is not None and parse_mix(kv).evicts)
        compress_upto = request.document_end if compresses else None
        return core.make_request(
            request.prompt, params, kv=kv, compress_upto=compress_upto, kv_auto="auto" if system == "auto" else None
        )

    def static_retrieval(self) -> str:
        """The profile's best single technique for retrieval: the cheapest mix with one component
        that meets the quality floor."""
        singles = [entry for entry in self.profile.mixes if "+" not in entry.mix]
        meeting = [e for e in singles if e.quality["retrieval"] >= self.config.quality] or singles
        return min(meeting, key=lambda e: e.bytes_fraction).mix

    @staticmethod
    def _drive(core, engine_requests, arrivals: list[float], bar, workload: list[WorkloadRequest]) -> tuple[float, int]:
        """Add each request at its arrival time and step until all are done; (start, peak KV bytes)."""
        order = sorted((i for i, w in enumerate(workload) if w.follows is None), key=lambda i: arrivals[i])
        followers = {w.follows: i for i, w in enumerate(workload) if w.follows is not None}
        position = {id(request): i for i, request in enumerate(engine_requests)}
        started, cursor, peak = time.monotonic(), 0, 0

        def send(index: int) -> None:
            engine_requests[index].arrival = time.monotonic()
            core.add(engine_requests[index])

        while cursor < len(order) or core.has_work:
            now = time.monotonic() - started
            while cursor < len(order) and arrivals[order[cursor]] <= now:
                send(order[cursor])
                cursor += 1
            if not core.has_work:
                time.sleep(max(0.0, min(0.05, arrivals[order[cursor]] - now)))
                continue
            events = core.step()
            bar.update(sum(event.finish_reason is not None for event in events))
            for event in events:  # a conversation's next turn goes out when its last one ends
                index = position[id(event.request)]
                if event.finish_reason is not None and index in followers:
                    send(followers.pop(index))
            stats = core.kv.stats()
            held = stats.used_bytes + stats.quantized_bytes + (stats.swap_used_bytes or 0)
            peak = max(peak, held + sum(tier.bytes_held for tier in stats.tiers))
        return started, peak

    # ---- quality -------------------------------------------------------------------------------
    def score(self, rows: list[dict], reference: dict) -> list[dict]:
        full = reference["requests"]
        correct_full = {
            i: self.requests[i].answer in (full[i]["answer"] or "")
            for i, r in enumerate(self.requests)
            if r.answer is not None
        }
        accuracy_full = sum(correct_full.values()) / max(1, len(correct_full))
        self._score_replies(rows, full)
        classes_here = list(dict.fromkeys(request.klass for request in self.requests))
        scored = []
        for row in tqdm(rows, desc="score", unit="run"):
            per_request = []
            for index, (request, outcome) in enumerate(zip(self.requests, row["requests"])):
                if request.answer is not None:  # retrieval, doc store: the key in the answer
                    hit = request.answer in (outcome["answer"] or "")
                    # capped per class, not per request: a system as accurate as full scores 1
                    per_request.append(hit / accuracy_full if accuracy_full else 1.0)
                elif plan := _plan_key(outcome):  # full's reply, under the mixes it held, against under the full cache
                    nll, own = self._replayed[index, plan], self._replayed[index, ()]
                    per_request.append(min(1.0, math.exp(own - nll)))
                else:  # it held the full cache throughout: full's reply scores as under full
                    per_request.append(1.0)
            classes = {
                klass: min(1.0, _mean(q for q, r in zip(per_request, self.requests) if r.klass == klass))
                for klass in classes_here
            }
            counts = {klass: sum(r.klass == klass for r in self.requests) for klass in classes_here}
            retrieval = [
                self.requests[i].answer in (o["answer"] or "")
                for i, o in enumerate(row["requests"])
                if self.requests[i].answer is not None
            ]
            scored.append(
                {
                    **_summary(row),
                    "system": row["system"],
                    "budget": row["budget"],
                    "repeat": row["repeat"],
                    "quality": sum(classes[k] * counts[k] for k in classes_here) / len(self.requests),
                    "class_quality": classes,
                    "retrieval_accuracy": _mean(retrieval),
                    "full_retrieval_accuracy": accuracy_full,
                    "compressed_requests": sum(o["settings"] is not None for o in row["requests"]),
                    "document_hits": sum(bool(o.get("document_hit")) for o in row["requests"]),
                }
            )
        return scored

    def _score_replies(self, rows: list[dict], full: list[dict]) -> None:
        """Each reply of the full cache without a key to match, scored in the engine under every
        plan (the mixes held, and from which token) a system's request had, and under the full
        cache (full's own plan, empty) wherever another plan needs it to compare with."""
        from kvwise.bench.engine_scoring import ScoredReply, replay_nll

        wanted: dict[tuple[int, tuple], ScoredReply] = {}
        for row in rows:
            for index, outcome in enumerate(row["requests"]):
                plan = _plan_key(outcome)
                if self.requests[index].answer is not None or not plan:
                    continue
                for key, reference in (((index, ()), full[index]), ((index, plan), outcome)):
                    if key not in self._replayed:
                        reply = full[index]["reply"]
                        wanted[key] = ScoredReply(
                            self.requests[index].prompt, reply, key[1], reference["compress_upto"]
                        )
        scores = replay_nll(self.model, self.tokenizer, list(wanted.values()), progress="score replies")
        self._replayed.update(zip(wanted, scores))


def _document_hit(request, workload: WorkloadRequest) -> bool | None:
    """Whether a doc-store request found its document cached (compressed, or in full on the device
    or in the tiers, all but a partial last block); None for other requests."""
    if workload.document_end is None:
        return None
    return request.compressed_hit or request.reused + CacheConfig.block_size > workload.document_end


def workload_name(spec) -> str:
    return next(name for name, kind in WORKLOADS.items() if isinstance(spec, kind))


def _is_mix(name: str) -> bool:
    """Whether `name` is a KV mix spec (`parse_mix`), which runs as a fixed system."""
    try:
        parse_mix(name)
    except ValueError:
        return False
    return True


def _plan(request) -> list[list]:
    """The mixes a request held and from when, as [[tokens in KV memory, mix, quantized at once]]:
    its own mix from the start, then each change a controller made (`Request.kv_changes`)."""
    own = [[0, request.kv.spec, False]] if request.kv is not None and not request.kv_changes else []
    changes = [c for c in request.kv_changes if c.at > 0 or parse_mix(c.mix).spec != "full"]  # full: the default
    return own + [[change.at, change.mix, change.quantize_now] for change in changes]


def _plan_key(outcome: dict) -> tuple:
    return tuple(KVChange(*change) for change in outcome["plan"])


def _settings_spec(kv: KVSettings | None) -> str | None:
    return None if kv is None else kv.spec


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else float("nan")


def _summary(row: dict) -> dict:
    return {key: value for key, value in row.items() if key not in ("requests", "key")}


# ---- report ------------------------------------------------------------------------------------
def aggregate(results: list[dict]) -> list[dict]:
    """One row per (budget, system): means over repeats, with the spread (max - min) / mean."""
    groups: dict[tuple, list[dict]] = {}
    for row in results:
        groups.setdefault((row["budget"], row["system"]), []).append(row)
    merged = []
    for (budget, system), rows in groups.items():
        mean = {
            key: _mean(r.get(key, 0) for r in rows)
            for key in (
                "quality",
                "tokens_per_second",
                "retrieval_accuracy",
                "ttft_p50_s",
                "ttft_p99_s",
                "preemptions",
                "peak_kv_bytes",
                "compressed_requests",
                "document_hits",
            )
        }
        classes = {k: _mean(r["class_quality"].get(k, float("nan")) for r in rows) for k in rows[0]["class_quality"]}
        spread = {
            key: (max(r[key] for r in rows) - min(r[key] for r in rows)) / mean[key] if mean[key] else 0.0
            for key in ("quality", "tokens_per_second")
        }
        actions: dict[str, int] = {}
        for r in rows:
            for name, count in r["actions"].items():
                actions[name] = actions.get(name, 0) + count
        merged.append(
            {
                "budget": budget,
                "system": system,
                "repeats": len(rows),
                **mean,
                "class_quality": classes,
                "spread": spread,
                "actions": actions,
                "budget_bytes": rows[0]["budget_bytes"],
                "full_retrieval_accuracy": rows[0]["full_retrieval_accuracy"],
            }
        )
    return merged


def markdown(report: dict) -> str:
    config = report["config"]
    name = report.get("workload_name", "mixed")
    budget_basis = (
        "a budget of f is f x the documents' full KV, over the pool and the host tier"
        if name == "doc-store"
        else f"a budget of f gives the pool f of it: the budget is f x peak / {report.get('pool_share', POOL_SHARE)}"
    )
    lines = [
        f"{_workload_line(report, name)}, peak full-cache demand {report['peak_demand_bytes']:,} bytes "
        f"({budget_basis}), auto's floor {config['quality']}, dtype {report.get('dtype', 'float32')}, "
        f"model={model_label(config)}",
        system_line(report["system"]),
        "",
    ]
    merged = aggregate(report["results"])
    unlimited = report.get("reference", {}).get("tokens_per_second")
    for budget in dict.fromkeys(row["budget"] for row in merged):
        rows = [row for row in merged if row["budget"] == budget]
        full = next((row for row in rows if row["system"] == "full"), None)
        classes = list(rows[0]["class_quality"])
        basis = "the documents' full KV" if name == "doc-store" else "peak demand"
        lines.append(f"Budget {budget} of {basis} ({rows[0]['budget_bytes']:,} bytes):")
        if full and unlimited:
            ratio = full["tokens_per_second"] / unlimited
            bound = "memory-bound" if ratio <= MEMORY_BOUND else "not memory-bound"
            lines.append(
                f"full here serves {ratio:.2f}x the output tok/s of full with unlimited memory ({unlimited:.2f}): "
                f"{bound} (<= {MEMORY_BOUND})."
            )
            if name == "doc-store":
                reference = report["reference"]
                lines.append(
                    f"Its TTFT p50 is {full['ttft_p50_s'] / reference['ttft_p50_s']:.2f}x that of full with unlimited "
                    f"memory ({reference['ttft_p50_s']:.2f} s)."
                )
        lines += [
            "",
            "| system | quality | "
            + " | ".join(CLASS_LABELS.get(k, k) for k in classes)
            + f" | {'answer' if name == 'doc-store' else 'retrieval'} acc | output tok/s | vs full | "
            "TTFT p50 / p99 (s) | vs full TTFT p50 | preemptions | peak KV bytes | compressed | doc hits | "
            "spread q / tps | actions |",
            "|---|---|" + "---|" * len(classes) + "---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            c = row["class_quality"]
            versus = f"{row['tokens_per_second'] / full['tokens_per_second']:.2f}x" if full else ""
            actions = ", ".join(f"{k} {v}" for k, v in sorted(row["actions"].items())) or "-"
            accuracy = (
                f"{row['retrieval_accuracy']:.2f} (full {row['full_retrieval_accuracy']:.2f})"
                if "retrieval" in classes or DOC_STORE in classes
                else "-"
            )
            ttft_versus = f"{row['ttft_p50_s'] / full['ttft_p50_s']:.2f}x" if full and full["ttft_p50_s"] else ""
            hits = f"{row['document_hits']:.0f}" if DOC_STORE in classes else "-"
            lines.append(
                f"| {row['system']} | {row['quality']:.3f} | "
                + " | ".join(f"{c[k]:.3f}" for k in classes)
                + f" | {accuracy} | {row['tokens_per_second']:.2f} | {versus} | "
                f"{row['ttft_p50_s']:.2f} / {row['ttft_p99_s']:.2f} | {ttft_versus} | {row['preemptions']:.0f} | "
                f"{row['peak_kv_bytes']:,.0f} | {row['compressed_requests']:.0f} | {hits} | "
                f"{row['spread']['quality']:.3f} / {row['spread']['tokens_per_second']:.3f} | {actions} |"
            )
        lines.append("")
    return "\n".join(lines)


def _workload_line(report: dict, name: str) -> str:
    """What the workload was, for the report's first line."""
    workload = report["config"]["workload"]
    if name == "doc-store":
        return (
            f"Adaptive KV, doc store: {workload['requests']} questions over {workload['documents']} documents of "
            f"{workload['document_tokens'][0]}-{workload['document_tokens'][1]} tokens, "
            f"Zipf {workload['zipf_exponent']}, "
            f"{workload['clients']} clients, seed {workload['seed']}, haystack "
            f"{workload['haystack_dir'] or 'built-in essays (bench part)'}, closed loop, a host tier for every system; "
            f"the documents' full KV is {report['documents_bytes']:,} bytes"
        )
    elif name == "long-chat":
        return (
            f"Adaptive KV, long chat: {workload['conversations']} conversations of {workload['turns']} turns, "
            f"histories to {workload['history_tokens'][0]}-{workload['history_tokens'][1]} tokens, replies of "
            f"{workload['reply_tokens'][0]}-{workload['reply_tokens'][1]} tokens, seed {workload['seed']}, "
            f"haystack {workload['haystack_dir'] or 'built-in essays (bench part)'}, closed loop"
        )
    else:
        return (
            f"Adaptive KV, {workload['requests']} requests (retrieval/chat/short/long "
            f"{'/'.join(str(p) for p in workload['proportions'])}), seed {workload['seed']}, "
            f"haystack {workload['haystack_dir'] or 'built-in essays (bench part)'}, rate {report['rate']:.3f} req/s "
            f"({report['rate_source']})"
        )


def plot(report: dict, path: Path) -> None:
    plt = headless_pyplot("plot")
    if plt is None:
        return
    merged = aggregate(report["results"])
    budgets = list(dict.fromkeys(row["budget"] for row in merged))
    # doc-store is judged on time to first token (lower is better), the others on output tok/s
    axis_key, axis_label = (
        ("ttft_p50_s", "TTFT p50 (s)")
        if report.get("workload_name") == "doc-store"
        else ("tokens_per_second", "output tokens/s")
    )
    figure, axes = plt.subplots(1, len(budgets), figsize=(6 * len(budgets), 4.5), squeeze=False)
    for axis, budget in zip(axes[0], budgets):
        rows = [row for row in merged if row["budget"] == budget]
        for row in rows:
            color = "tab:red" if row["system"] == "auto" else ("black" if row["system"] == "full" else "tab:blue")
            axis.scatter(row[axis_key], row["quality"], color=color, s=30)
            axis.annotate(
                row["system"],
                (row[axis_key], row["quality"]),
                fontsize=8,
                xytext=(3, 3),
                textcoords="offset points",
            )
        axis.set_title(f"budget {budget} of peak demand")
        axis.set_xlabel(axis_label)
        axis.set_ylabel("quality vs full at unlimited memory")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
