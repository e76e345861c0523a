"""`kvwise bench isolation`: can one tenant learn what another cached? Measured, not assumed.

A live server on loopback (the embedded model by default), two tenants with their own keys:
- **Timing probe.** The victim sends a random `prefix_tokens`-token prompt, so its prefix is
  cached. The prober then sends either that prefix (target) or a fresh random one (control), each
  with a fresh suffix, and times the answer (one output token: the TTFT a client sees). A probe
  that can tell the classes apart reads another tenant's cache. Reported per mode: the prober's
  cache hits on targets, and the ROC AUC of "control slower than target" (0.5: no signal).
  - `isolated`: plain tenants. Hits must be 0 and the AUC near 0.5.
  - `shared`: both mark the prefix shared (`kv_prefix`). Hits are the point of sharing, so the
    AUC must be high: the positive control, which shows the probe is strong enough to count.
  - `shared-padded`: the same, on a server with `--shared-timing-pad`: a shared hit's first token
    is held as long as computing the hit would have taken, so the AUC falls back towards 0.5.
- **Hit probes.** The timing probe needs its trials one at a time; counting hits does not. After
  the trials the victim caches `hit_probes` more random prefixes and the prober sends each one
  back, `hit_probe_concurrency` at a time (batched by the engine), so the count of cross-tenant
  hits rests on a thousand probes in minutes. Hits are read from the engine (each request's
  prompt tokens found in the cache, at admission), not inferred from timing.
- **Flooding.** The victim repeats one prefix while the flooder sends unique prompts, totalling
  `flood_factor` times the pool between two of the victim's requests. Reported: the victim's hit
  rate on its prefix, with fair prefix-cache shares (the default) and without them, in one run.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from kvwise.bench.report_files import model_label, new_report, system_line, write_report

MODES = ("isolated", "shared", "shared-padded")
KEYS = {"victim": "sk-bench-victim", "prober": "sk-bench-prober"}


@dataclass
class IsolationConfig:
    model: str | None = None
    trials: int = 200  # per class (target, control) and mode
    prefix_tokens: int = 512
    suffix_tokens: int = 8
    modes: tuple[str, ...] = MODES
    hit_probes: int = 1000  # per mode, sent concurrently after the timed trials
    hit_probe_tokens: int = 64  # a hit needs one whole block in common; longer prefixes only cost time
    hit_probe_concurrency: int = 32  # requests in flight; the server queues 32 per tenant
    flood_factor: float = 3.0  # the flooder's unique tokens between two victim requests, in pools
    probes: bool = True  # False: the flood test only
    flood_pool_blocks: int = 128  # the flood test's pool (16-token blocks)
    victim_repeats: int = 8
    seed: int = 0

    def __post_init__(self):
        unknown = [mode for mode in self.modes if mode not in MODES]
        if unknown:
            raise ValueError(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
        if self.trials < 2 or self.prefix_tokens < 32 or self.flood_factor <= 0 or self.victim_repeats < 2:
            raise ValueError("trials >= 2, prefix_tokens >= 32, flood_factor > 0 and victim_repeats >= 2")
        if self.hit_probes < 0 or self.hit_probe_tokens < 32 or not 1 <= self.hit_probe_concurrency <= 32:
            raise ValueError("hit_probes >= 0, hit_probe_tokens >= 32 and hit_probe_concurrency in 1..32")


@dataclass
class Probe:
    mode: str
    target: bool
    ttft: float
    hit_tokens: float


@dataclass
class HitProbes:
    mode: str
    probes: int
    hits: int  # probes that found any of their prompt in the cache


@dataclass
class ProbeServer:
    """A server with the bench's tenants, a client, and each request's cache hit as the engine saw it."""

    model: object
    tokenizer: object
    num_blocks: int = 2048
    fair_prefix_shares: bool = True
    shared_timing_pad: bool = False
    server: object = field(init=False)

    def __post_init__(self):
        import httpx

        from kvwise.bench.loopback_server import LoopbackServer
        from kvwise.engine.config import CacheConfig
        from kvwise.engine.core import EngineCore
        from kvwise.server.api_keys import KeyEntry
        from kvwise.server.app import ServerSettings, create_app

        keys = {
            KEYS["victim"]: KeyEntry("victim", shared_read=True, shared_write=True),
            KEYS["prober"]: KeyEntry("prober", shared_read=True, shared_write=True),
        }
        cache = CacheConfig(num_blocks=self.num_blocks, fair_prefix_shares=self.fair_prefix_shares)
        core = EngineCore(self.model, self.tokenizer, cache)
        # {request_id: (tenant, prompt tokens found in the cache)}, written on the engine thread
        self.admissions: dict[str, tuple[str, int]] = {}
        core.scheduler.on_admit.append(self._record_admission)
        settings = ServerSettings("bench", keys, max_queue=64, shared_timing_pad=self.shared_timing_pad)
        self.server = LoopbackServer(create_app(core, settings))
        self.http = httpx.Client(base_url=self.server.base_url, timeout=300)

    def _record_admission(self, request) -> None:
        # the first admission's lookup is the request's hit; a preempted request is admitted again
        self.admissions.setdefault(request.request_id, (request.tenant, request.reused))

    def complete(self, tenant: str, tokens: list[int], shared_tokens: int = 0) -> float:
        """Seconds until the answer (one token) arrives."""
        body = {"model": "bench", "prompt": tokens, "max_tokens": 1, "temperature": 0}
        if shared_tokens:
            body["kv_prefix"] = {"tokens": shared_tokens, "shared": True}
        started = time.perf_counter()
        answer = self.http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS[tenant]}"})
        elapsed = time.perf_counter() - started
        answer.raise_for_status()
        return elapsed

    def complete_all(self, tenant: str, prompts: list[list[int]], shared_tokens: int, concurrency: int) -> None:
        """All `prompts` at once, `concurrency` in flight (httpx's client is thread-safe)."""
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda tokens: self.complete(tenant, tokens, shared_tokens), prompts))

    def hit_tokens(self, tenant: str, since: int = 0) -> list[int]:
        """Cache hits (prompt tokens) of `tenant`'s requests, in admission order from the `since`-th admission."""
        admitted = list(self.admissions.values())[since:]  # one C-level copy while the engine thread writes
        return [reused for owner, reused in admitted if owner == tenant]

    def hits(self, tenant: str) -> float:
        return sum(self.hit_tokens(tenant))

    def close(self) -> None:
        self.http.close()
        self.server.stop()


def roc_auc(slower: list[float], faster: list[float]) -> float:
    """P(a value of `slower` exceeds one of `faster`), ties counted half (Mann-Whitney)."""
    wins = sum((s > f) + 0.5 * (s == f) for s in slower for f in faster)
    return wins / (len(slower) * len(faster))


def run_probes(
    model, tokenizer, config: IsolationConfig, mode: str, vocab: int, progress
) -> tuple[list[Probe], HitProbes]:
    """One mode's timed probes, then its hit probes, on a server of its own (padding is a server setting)."""
    rng = random.Random(f"{config.seed}-{mode}")

    def tokens(count: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(count)]

    server = ProbeServer(model, tokenizer, shared_timing_pad=mode == "shared-padded")
    probes = []
    try:
        shared = config.prefix_tokens if mode.startswith("shared") else 0
        for length in (config.prefix_tokens, config.suffix_tokens, config.prefix_tokens // 2):
            server.complete("victim", tokens(length + config.suffix_tokens))  # warm-up; the pad's cost estimate
        classes = [True] * config.trials + [False] * config.trials
        rng.shuffle(classes)  # targets and controls interleaved at random: drift hits both alike
        for target in classes:
            cached = tokens(config.prefix_tokens)
            server.complete("victim", cached + tokens(config.suffix_tokens), shared)
            probe_prefix = cached if target else tokens(config.prefix_tokens)
            before = server.hits("prober")
            ttft = server.complete("prober", probe_prefix + tokens(config.suffix_tokens), shared)
            probes.append(Probe(mode, target, ttft, server.hits("prober") - before))
            progress.update()
        hit_probes = run_hit_probes(server, config, mode, tokens, progress)
    finally:
        server.close()
    return probes, hit_probes


def run_hit_probes(server: ProbeServer, config: IsolationConfig, mode: str, tokens, progress) -> HitProbes:
    """The victim caches a batch of fresh prefixes, then the prober sends each back with a fresh
    suffix, the whole batch at once; repeated until `hit_probes` probes. Each batch is probed
    right after it is cached, so its prefixes are still in the pool: the shared mode, where
    every probe must hit, shows it."""
    shared = config.hit_probe_tokens if mode.startswith("shared") else 0
    hits = 0
    for first in range(0, config.hit_probes, config.hit_probe_concurrency):
        batch = min(config.hit_probe_concurrency, config.hit_probes - first)
        prefixes = [tokens(config.hit_probe_tokens) for _ in range(batch)]
        cached = [prefix + tokens(config.suffix_tokens) for prefix in prefixes]
        server.complete_all("victim", cached, shared, config.hit_probe_concurrency)
        since = len(server.admissions)
        probes = [prefix + tokens(config.suffix_tokens) for prefix in prefixes]
        server.complete_all("prober", probes, shared, config.hit_probe_concurrency)
        hits += sum(reused > 0 for reused in server.hit_tokens("prober", since))
        progress.update(batch)
    return HitProbes(mode, config.hit_probes, hits)


def run_flood(model, tokenizer, config: IsolationConfig, fair: bool, vocab: int, progress) -> dict:
    """The victim's hit rate on its repeated prefix while the flooder sends unique prompts."""
    rng = random.Random(config.seed + 1)
    server = ProbeServer(model, tokenizer, num_blocks=config.flood_pool_blocks, fair_prefix_shares=fair)
    try:
        prefix = [rng.randrange(10, vocab) for _ in range(config.prefix_tokens)]
        pool_tokens = config.flood_pool_blocks * 16
        # between two of the victim's requests the flooder sends flood_factor pools of unique tokens
        per_round = max(1, round(config.flood_factor * pool_tokens / config.prefix_tokens))
        server.complete("victim", prefix + [11, 12])
        hits_before, sent = server.hits("victim"), 0
        for repeat in range(config.victim_repeats - 1):
            for _ in range(per_round):
                flood = [rng.randrange(10, vocab) for _ in range(config.prefix_tokens)]
                server.complete("prober", flood)  # the prober's key floods here
                sent += config.prefix_tokens
                progress.update()
            server.complete("victim", prefix + [13 + repeat])
        cacheable = (config.prefix_tokens + 1) // 16 * 16 * (config.victim_repeats - 1)
        hit_rate = (server.hits("victim") - hits_before) / cacheable
    finally:
        server.close()
    return {"fair_prefix_shares": fair, "victim_hit_rate": hit_rate, "flood_tokens": sent, "pool_tokens": pool_tokens}


def run_isolation(config: IsolationConfig, out_dir: Path) -> dict:
    from kvwise.models import load_model

    model, tokenizer = load_model(config.model)
    vocab = model.get_input_embeddings().num_embeddings
    per_round = max(1, round(config.flood_factor * config.flood_pool_blocks * 16 / config.prefix_tokens))
    modes = config.modes if config.probes else ()
    total = (2 * config.trials + config.hit_probes) * len(modes) + 2 * per_round * (config.victim_repeats - 1)
    with tqdm(total=total, desc="isolation", unit="probe") as progress:
        probes, hit_probes = [], {}
        for mode in modes:
            timed, hit_probes[mode] = run_probes(model, tokenizer, config, mode, vocab, progress)
            probes += timed
        floods = [run_flood(model, tokenizer, config, fair, vocab, progress) for fair in (True, False)]
    summary = []
    for mode in modes:
        rows = [probe for probe in probes if probe.mode == mode]
        targets = [probe for probe in rows if probe.target]
        controls = [probe for probe in rows if not probe.target]
        summary.append(
            {
                "mode": mode,
                "trials_per_class": len(targets),
                "target_hits": sum(probe.hit_tokens > 0 for probe in targets),
                "control_hits": sum(probe.hit_tokens > 0 for probe in controls),
                "hit_probes": hit_probes[mode].probes,
                "hit_probe_hits": hit_probes[mode].hits,
                "auc": roc_auc([p.ttft for p in controls], [p.ttft for p in targets]),
                "target_ttft_median": sorted(p.ttft for p in targets)[len(targets) // 2],
                "control_ttft_median": sorted(p.ttft for p in controls)[len(controls) // 2],
            }
        )
    results = {"probes": summary, "flood": floods, "raw": [asdict(probe) for probe in probes]}
    report = new_report("isolation", config, model.device, results=results)
    return write_report(out_dir, report, markdown, {"isolation_ttft.png": _plot} if modes else None)


def markdown(report: dict) -> str:
    config, system = report["config"], report["system"]
    lines = [
        f"Isolation, model={model_label(config)}, {config['trials']} trials per class and "
        f"mode, {config['prefix_tokens']}-token prefixes, seed={config['seed']}",
        system_line(system, "torch"),
        "",
    ]
    if report["results"]["probes"]:
        lines += [
            "Timing probe: the prober sends the victim's cached prefix (target) or a fresh one (control); "
            "AUC = P(control TTFT > target TTFT); 0.5 is no signal. Hit probes: the prober sends back "
            f"{config['hit_probes']} more of the victim's cached {config['hit_probe_tokens']}-token prefixes, "
            f"{config['hit_probe_concurrency']} at a time; hits as the engine counted them.",
            "",
            "| mode | target hits | control hits | hit probes: hits | AUC | TTFT median target / control (s) |",
            "|---|---|---|---|---|---|",
        ]
    for row in report["results"]["probes"]:
        lines.append(
            f"| {row['mode']} | {row['target_hits']}/{row['trials_per_class']} | "
            f"{row['control_hits']}/{row['trials_per_class']} | {row['hit_probe_hits']}/{row['hit_probes']} | "
            f"{row['auc']:.2f} | "
            f"{row['target_ttft_median']:.3f} / {row['control_ttft_median']:.3f} |"
        )
    flood_title = "Flooding: the victim's hit rate on its repeated prefix while another tenant sends unique prompts."
    lines += ["", flood_title, ""]
    lines += ["| fair prefix shares | victim hit rate | flood tokens / pool tokens, in all |", "|---|---|---|"]
    for row in report["results"]["flood"]:
        lines.append(
            f"| {'on' if row['fair_prefix_shares'] else 'off'} | {row['victim_hit_rate']:.2f} | "
            f"{row['flood_tokens'] / row['pool_tokens']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [row["mode"] for row in report["results"]["probes"]]
    figure, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.5), squeeze=False)
    for axis, mode in zip(axes[0], modes):
        rows = [row for row in report["results"]["raw"] if row["mode"] == mode]
        for target, label in ((True, "target (victim's prefix)"), (False, "control (fresh prefix)")):
            axis.hist([row["ttft"] for row in rows if row["target"] is target], bins=30, alpha=0.6, label=label)
        axis.set_title(f"{mode}")
        axis.set_xlabel("TTFT (s)")
    axes[0][0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
