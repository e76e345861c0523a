"""The `kvwise` command line: policies, generate, demo, serve, check-model, bench."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from kvwise._version import __version__
from kvwise.bench.commands import add_bench_parsers, run_bench
from kvwise.server.serve import add_serve_arguments
from kvwise.util.extras import MissingExtra, require


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvwise", description="KV-cache management for LLM inference")
    parser.add_argument("--version", action="version", version=f"kvwise {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    commands.add_parser("policies", help="list the eviction policies")
    commands.add_parser("build-kernels", help="build the CPU decode kernels now (the server otherwise builds them)")
    report = commands.add_parser("report", help="every benchmark report under a folder on one offline HTML page")
    report.add_argument("directory", help="a results folder (any of the benches, or all of them)")
    report.add_argument("--out", default=None, help="the page to write (default: DIRECTORY/report.html)")

    generate = commands.add_parser("generate", help="generate with a compressed KV cache")
    generate.add_argument("--prompt", help="the prompt text")
    generate.add_argument("--prompt-file", help="read the prompt from this file")
    generate.add_argument("--policy", default="snapkv")
    generate.add_argument("--ratio", type=float, default=0.5, help="fraction of the prompt's KV removed, in [0, 1)")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--max-kv-tokens", type=int, default=None, help="decode-time budget per head")
    generate.add_argument("--quant", default=None, help="store the KV in kivi2, kivi4, int8 or fp8")
    generate.add_argument("--model", default=None, help="HF hub id or local directory (default: embedded SmolLM2)")
    generate.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")

    demo = commands.add_parser("demo", help="compress a long essay and answer a question about it")
    demo.add_argument("--policy", default="kvzip")
    demo.add_argument("--ratio", type=float, default=0.9)
    demo.add_argument("--model", default=None)

    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible server on the engine",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument("--version", action="version", version=f"kvwise {__version__}")
    add_serve_arguments(serve)
    parser.serve_parser = serve  # main() reads --config files against serve's own flags

    check = commands.add_parser(
        "check-model", help="check that kvwise computes what a model computes (engine and cache against generate)"
    )
    check.add_argument("model", nargs="?", default=None, help="HF hub id or local directory (default: embedded)")
    check.add_argument("--policies", default="snapkv,kvzip", help="policies whose budgets are checked (comma list)")
    check.add_argument("--ratio", type=float, default=0.5, help="compression ratio of the budget checks")
    check.add_argument("--text-file", default=None, help="text to cut prompts from (default: the haystack essays)")
    check.add_argument("--device", default="cpu", help="cpu (default), cuda or auto; the checks run in float32")

    calibrate = commands.add_parser(
        "calibrate", help="measure what each KV mix keeps and costs on a model: the profile `--kv-policy auto` uses"
    )
    calibrate.add_argument("--model", default=None, help="HF hub id or local directory (default: embedded SmolLM2)")
    calibrate.add_argument(
        "--data", default=None, help="a folder of your .txt/.md documents to probe on (default: built-in essays)"
    )
    calibrate.add_argument("--budget-minutes", type=float, default=None, help="stop starting new mixes after this")
    calibrate.add_argument("--mixes", default=None, help="comma list of mixes (default: 23, or 8 with --quick)")
    calibrate.add_argument("--quick", action="store_true", help="8 mixes on fewer probes (a few minutes)")
    calibrate.add_argument("--seed", type=int, default=0)
    calibrate.add_argument("--out", default=None, help="folder for the profile (default: $KVWISE_HOME/profiles)")
    calibrate.add_argument("--no-resume", action="store_true", help="ignore rows of an interrupted run")
    calibrate.add_argument(
        "--surrogate",
        choices=["train", "skip", "only"],
        default="train",
        help="kvzap's score surrogate and the lowrank quantizer's bases: train them beside the profile "
        "(default; kept if already there), skip them, or train only them",
    )
    calibrate.add_argument(
        "--costs",
        choices=["measure", "skip", "only"],
        default="measure",
        help="what auto's actions cost on this machine (decode steps per KV form, a context pass): measure them "
        "into the profile (default, a few minutes), skip them, or only measure them into the profile already in --out",
    )

    bench = commands.add_parser("bench", help="benchmarks")
    add_bench_parsers(bench.add_subparsers(dest="workload", required=True))
    return parser


def _read_prompt(args) -> str:
    if args.prompt_file:
        try:
            return Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"cannot read prompt file {args.prompt_file!r}: {error.strerror or error}") from None
    if args.prompt is None:
        raise ValueError("give --prompt TEXT or --prompt-file F")
    return args.prompt


def _command_policies(args) -> None:
    from kvwise.policies.registry import policy_classes

    classes = policy_classes()
    width = max(map(len, classes))
    for name, cls in classes.items():
        print(f"{name:<{width}}  {cls.summary}")


def _command_generate(args) -> None:
    from kvwise.kv.quantizer import make_quantizer
    from kvwise.policies.registry import make_policy
    from kvwise.policies.selection import check_ratio

    check_ratio(args.ratio)
    make_policy(args.policy)
    make_quantizer(args.quant)
    prompt = _read_prompt(args)
    from kvwise.hf.run import generate_with_report
    from kvwise.models import load_model

    report = generate_with_report(
        prompt,
        load_model(args.model),
        policy=args.policy,
        ratio=args.ratio,
        max_new_tokens=args.max_new_tokens,
        max_kv_tokens=args.max_kv_tokens,
        chat=not args.no_chat_template,
        quant=args.quant,
    )
    print(report.completion)
    print(report.summary(), file=sys.stderr)


def _command_demo(args) -> None:
    from kvwise.demo import run_demo

    run_demo(policy=args.policy, ratio=args.ratio, model_name=args.model)


def _command_check_model(args) -> int:
    import torch

    from kvwise.hf.geometry import kv_geometry
    from kvwise.model_check import check_model
    from kvwise.models import load_model
    from kvwise.policies.registry import make_policy
    from kvwise.policies.selection import check_ratio

    check_ratio(args.ratio)
    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    for name in policies:
        make_policy(name)
    if args.text_file:
        text = Path(args.text_file).read_text(encoding="utf-8", errors="replace")
    else:
        from kvwise.bench.haystack import read_haystack

        text = read_haystack()
    model, tokenizer = load_model(args.model, device=args.device, dtype=torch.float32)
    shape = kv_geometry(model)
    sliding = shape.sliding_layers
    print(
        f"{type(model).__name__}: {shape.num_layers} layers ({len(sliding)} sliding-window), "
        f"{shape.num_kv_heads} KV heads of {shape.head_dim}, "
        f"chat template: {'yes' if getattr(tokenizer, 'chat_template', None) else 'no (plain prompts)'}"
    )
    verdicts = check_model(model, tokenizer, text, policies, args.ratio, progress=lambda v: print(v.line(), flush=True))
    failed = [verdict for verdict in verdicts if not verdict.passed]
    print("verdict: " + ("supported: every check passed" if not failed else f"{len(failed)} checks failed"))
    return 1 if failed else 0


def _command_bench(args) -> None:
    run_bench(args)


def _command_calibrate(args) -> None:
    from kvwise.adaptive.calibrate import DEFAULT_MIXES, CalibrateConfig, run_calibrate

    mixes = tuple(part.strip() for part in args.mixes.split(",") if part.strip()) if args.mixes else DEFAULT_MIXES
    config = CalibrateConfig(args.model, args.data, mixes, None, args.budget_minutes, args.seed, args.quick)
    config.surrogate, config.costs = args.surrogate, args.costs
    config.command = shlex.join(["kvwise", *sys.argv[1:]])
    path = run_calibrate(config, args.out, resume=not args.no_resume)
    if path.name.endswith(".kvzap.safetensors"):
        print(f"kvzap surrogate: {path}")
        print(f"low-rank bases: {path.with_name(path.name.replace('.kvzap.', '.lowrank.'))}")
        return
    print(path.with_suffix(".md").read_text())
    print(f"profile: {path}")


def _command_serve(args) -> None:
    for module in ("fastapi", "uvicorn", "prometheus_client"):
        require(module, "server", "kvwise serve")
    if args.replicas is not None:
        from kvwise.cluster.launch import run_cluster

        run_cluster(args)
        return
    if args.ray_address is not None:
        raise ValueError("--ray-address deploys replicas: give --replicas N too")
    from kvwise.server.serve import run_server

    run_server(args)


def _command_build_kernels(args) -> int:
    from kvwise.engine.cpu_kernel import cpu_kernels, kernel_status

    print(f"kvwise: {kernel_status(retry=True)}")
    return 0 if cpu_kernels() is not None else 1


def _command_report(args) -> None:
    from kvwise.bench.report import render_report

    print(f"kvwise: wrote {render_report(args.directory, args.out)}")


_COMMANDS = {
    "report": _command_report,
    "build-kernels": _command_build_kernels,
    "policies": _command_policies,
    "generate": _command_generate,
    "demo": _command_demo,
    "bench": _command_bench,
    "serve": _command_serve,
    "calibrate": _command_calibrate,
    "check-model": _command_check_model,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "config", None):  # the file's values become defaults: flags given still win
            from kvwise.server.serve import config_file_defaults

            serve = parser.serve_parser
            serve.set_defaults(**config_file_defaults(serve, args.config))
            args = parser.parse_args(argv)
        status = _COMMANDS[args.command](args)
    except ValueError as error:
        print(f"kvwise: error: {error}", file=sys.stderr)
        return 2
    except MissingExtra as error:
        print(f"kvwise: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvwise: interrupted", file=sys.stderr)
        return 130
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
