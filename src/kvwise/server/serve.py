"""`kvwise serve`: load the model, build the engine and run the app under uvicorn.

SIGINT/SIGTERM shut down gracefully: uvicorn stops accepting connections and waits for open
ones (streams included) for up to --shutdown-timeout seconds, then the engine drains.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvwise.engine.config import CacheConfig
from kvwise.server.key_files import API_KEY_ENVIRONMENT

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
DEFAULT_CPU_KV_MEMORY = 2 << 30  # capped further at a quarter of free RAM, so several servers fit
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20, "g": 1e9, "gb": 1e9}
_UNITS.update({"gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40})


def parse_bytes(text: str) -> int:
    """Bytes from `123`, `512MiB`, `4GiB`, `1.5GB` (case-insensitive)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4GiB, 512MiB, 1073741824)")
    return int(float(match.group(1)) * _UNITS[unit])


log = logging.getLogger("kvwise.server")


def add_serve_arguments(parser) -> None:
    """Every flag of `kvwise serve`, in groups: the server, KV memory and scheduling, prefix tiers,
    requests and their secrets, operations (metrics, timeouts, logs), scale-out, adaptive KV."""
    _add_server_flags(parser)
    _add_memory_flags(parser)
    _add_tier_flags(parser)
    _add_request_flags(parser)
    _add_operations_flags(parser)
    _add_cluster_flags(parser)
    _add_adaptive_flags(parser)


def _add_server_flags(parser) -> None:
    """The model, where the server listens, who may call it and how much it queues."""
    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="HF hub id or local directory (as --model)"
    )
    parser.add_argument("--model", default=None, help="HF hub id or local directory (default: embedded SmolLM2)")
    parser.add_argument("--served-model-name", default=None, help="the name clients send as `model`")
    parser.add_argument("--config", default=None, help="a YAML file of flags (keys as the flags, - or _); flags win")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-keys", default=None, help="file of `KEY TENANT [PERMISSION ...]` lines; none: no auth")
    parser.add_argument(
        "--api-key",
        default=None,  # KVWISE_API_KEY is read at startup: a default would print the key in --help
        help=f"one key for everything (tenant `default`, every permission; or {API_KEY_ENVIRONMENT}); "
        "not with --api-keys",
    )
    parser.add_argument("--max-queue", type=int, default=256, help="waiting requests before answering 429")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: per device)")
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt and output (default: the model's)"
    )


def _add_memory_flags(parser) -> None:
    """KV memory (pool, swap, quantized blocks), what a step computes, and the prefix cache's shares."""
    memory = parser.add_argument_group("KV memory")
    memory.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="all the KV memory, in bytes (4GiB, 512MiB, ...): pool, host swap and quantized blocks; sizes the pool "
        "(default on CPU: the smaller of 2 GiB and a quarter of free RAM; on CUDA: --gpu-memory-utilization 0.9)",
    )
    memory.add_argument(
        "--gpu-memory-utilization", type=float, default=None, help="CUDA: the share of the device's memory to use"
    )
    memory.add_argument("--num-blocks", type=int, default=None, help="a fixed pool size in blocks (overrides both)")
    memory.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    memory.add_argument(
        "--kv-cache-dtype",
        default=None,
        help="store every request's KV with this quantizer (kivi2, kivi4, int8, fp8) unless it asks otherwise",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        "--token-budget",
        dest="token_budget",
        type=int,
        default=CacheConfig.token_budget,
        help="tokens computed per step",
    )
    parser.add_argument(
        "--max-num-seqs", "--max-running", dest="max_running", type=int, default=CacheConfig.max_running
    )
    parser.add_argument(
        "--enable-prefix-caching", dest="prefix_caching", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false", help=argparse.SUPPRESS)
    parser.add_argument(
        "--swap-space-gb",
        type=float,
        default=None,
        help="host memory for preempted requests' KV (default: 4 with --num-blocks, else a share of the KV memory)",
    )
    parser.add_argument(
        "--prefix-quota-blocks",
        type=int,
        default=None,
        help="prefix-cache blocks a tenant may hold (default: all)",
    )
    parser.add_argument(
        "--no-fair-prefix-shares",
        action="store_true",
        help="without --prefix-quota-blocks, let any tenant fill the prefix cache (default: equal shares)",
    )


def _add_request_flags(parser) -> None:
    """What requests may ask for (chat template, kv_quant values) and the keys of their blocks' identity."""
    parser.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template (a file, or the template itself) for models without one, or to override it",
    )
    parser.add_argument(
        "--kv-quant-options",
        default=None,
        help="comma list of the kv_quant values requests may ask for, each with its own pool "
        "(default: kivi2,kivi4,int8,fp8 with default settings; none: no kv_quant)",
    )
    parser.add_argument(
        "--namespace-key-file",
        default=None,
        help="hex key(s) that key every cached block's identity, first line signing "
        "(default: generated on first start under $KVWISE_HOME/secrets)",
    )
    parser.add_argument(
        "--shared-timing-pad",
        action="store_true",
        help="hold a shared-namespace hit's first token as long as computing it would take (no timing signal)",
    )


def _add_operations_flags(parser) -> None:
    """Metrics, per-tenant fairness, defaults, timeouts against slow clients, and logs."""
    parser.add_argument("--metrics-key", default=None, help="a key that may scrape /metrics, besides `admin` keys")
    parser.add_argument(
        "--metrics-per-tenant", action="store_true", help="label prefix-cache counters by tenant (default: off)"
    )
    parser.add_argument("--metrics-max-tenants", type=int, default=32, help="tenants labelled; the rest are `other`")
    parser.add_argument(
        "--no-fair-queue", action="store_true", help="let one tenant fill the whole queue (default: equal shares)"
    )
    parser.add_argument("--default-max-tokens", type=int, default=256, help="for chat requests without max_tokens")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0)
    parser.add_argument(
        "--header-timeout", type=float, default=10.0, help="seconds a client has to send its request headers"
    )
    parser.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds a client may pause while sending a request body"
    )
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--log-stats-interval", type=float, default=10.0, help="seconds between engine stats lines (0: none)"
    )
    parser.add_argument(
        "--log-requests", action="store_true", help="a line per finished request: ids, lengths, timings, outcome"
    )
    parser.add_argument(
        "--log-request-text", action="store_true", help="with --log-requests: the prompt and output text too"
    )


def _add_cluster_flags(parser) -> None:
    """Scale-out: engine replicas on Ray Serve (read by kvwise.cluster.launch)."""
    cluster = parser.add_argument_group("scale-out on Ray Serve (the cluster extra)")
    cluster.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="run N engine replicas on Ray Serve behind one ingress on --host/--port (KV memory flags are per "
        "replica; with --redis-url they share prefixes through it)",
    )
    cluster.add_argument(
        "--ray-address", default=None, help="an existing Ray cluster to deploy on (default: start a local one)"
    )
    cluster.add_argument(
        "--router",
        choices=["kvwise", "pow2", "text-prefix"],
        default="kvwise",
        help="kvwise: by where each prefix's blocks are; pow2: Ray's power of two choices; text-prefix: a text "
        "prefix tree as Ray Serve LLM's PrefixCacheAffinityRouter",
    )
    cluster.add_argument("--replica-gpus", type=float, default=0, help="GPUs each replica asks Ray for")


def config_file_defaults(parser, path: str) -> dict:
    """The flags a --config YAML file sets, as parser defaults (so flags on the command line win).
    Keys are the flags' names, with - or _; unknown keys and bad values raise ValueError."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise ValueError(f"--config {path}: cannot read it: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    actions = {}  # every spelling of a flag (max-num-seqs, max_running, ...) -> its action
    for action in parser._actions:  # noqa: SLF001  (argparse has no public list of its actions)
        if action.dest not in ("help", "version", "config"):
            for name in (action.dest, *action.option_strings):
                actions[name.lstrip("-").replace("-", "_")] = action
    defaults = {}
    for key, value in data.items():
        dest = str(key).strip().lstrip("-").replace("-", "_")
        action = actions.get(dest)
        if action is None:
            raise ValueError(f"--config {path}: unknown key {key!r} (keys are serve's flags, e.g. max-model-len)")
        if isinstance(value, str) and action.type is not None:
            try:
                value = action.type(value)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as error:
                raise ValueError(f"--config {path}: {key}: {error}") from None
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"--config {path}: {key} must be one of {list(action.choices)}, got {value!r}")
        if isinstance(action, argparse._AppendAction):  # noqa: SLF001  (argparse's type for action="append")
            value = [value] if isinstance(value, str) else list(value)
        elif dest.startswith("no_") and not action.dest.startswith("no_"):  # a negative spelling of the flag
            if not isinstance(value, bool):
                raise ValueError(f"--config {path}: {key} is true or false, got {value!r}")
            value = not value  # `no-enable-prefix-caching: true` turns prefix caching off
        defaults[action.dest] = value
    return defaults


@dataclass
class CheckedFlags:
    """What the flags decide before the model loads (every flag error is raised making it)."""

    model_name: str | None
    cache: CacheConfig  # the pool not sized yet, unless --num-blocks
    kv_quant_options: frozenset[str]
    default_quant: str | None
    adaptive: object | None  # AdaptiveConfig with --kv-policy auto
    budget: int | None  # KV memory in bytes
    tiers: list


def check_flags(args, server_keys) -> CheckedFlags:
    """Check every flag a server (or each of the cluster's replicas) is built from, before
    anything heavy happens, and build the tiers under the prefix cache."""
    from kvwise.server.kv_fields import parse_kv_quant_options

    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    model_name = model_flag(args)
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ValueError(f"--max-model-len must be positive, got {args.max_model_len}")
    cache = CacheConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks or CacheConfig.num_blocks,  # sized from memory later unless given
        token_budget=args.token_budget,
        max_running=args.max_running,
        prefix_caching=args.prefix_caching,
        swap_space_bytes=int((4.0 if args.swap_space_gb is None else args.swap_space_gb) * (1 << 30)),
        prefix_quota_blocks=args.prefix_quota_blocks,
        fair_prefix_shares=not args.no_fair_prefix_shares,
        publish_prefixes=publish_prefixes(args),
    )
    kv_quant_options = parse_kv_quant_options(args.kv_quant_options)
    default_quant = kv_cache_dtype(args, kv_quant_options)
    adaptive = adaptive_config(args, kv_quant_options)
    budget = kv_memory_flag(args)
    tiers = prefix_tiers(args, server_keys)
    return CheckedFlags(model_name, cache, kv_quant_options, default_quant, adaptive, budget, tiers)


def build_app(args, keys=None):
    """The app for parsed `serve` arguments (also used by tests, without uvicorn's CLI). keys: the
    `ServerKeys` to use instead of reading the key files (replicas get the ingress's)."""
    from kvwise.engine.core import EngineCore
    from kvwise.models import load_model
    from kvwise.server.app import create_app
    from kvwise.server.key_files import read_server_keys

    server_keys = keys if keys is not None else read_server_keys(args)
    flags = check_flags(args, server_keys)  # before the model loads
    model, tokenizer = load_model(flags.model_name, device=args.device, dtype=args.dtype)
    if model.device.type == "cpu":  # built (or found) now, before /health answers: never on a first request
        from kvwise.engine.cpu_kernel import kernel_status

        log.info("%s", kernel_status())
    name = served_name(args)
    cache = size_pool(args, model, flags.cache, flags.budget)
    adaptive = flags.adaptive
    controller = adaptive_controller(args, adaptive, model, tokenizer) if adaptive is not None else None
    core = EngineCore(model, tokenizer, cache, flags.tiers, namespace_key=server_keys.namespace)
    if args.max_model_len is not None:
        core.max_positions = min(args.max_model_len, core.max_positions or args.max_model_len)
    log.info(
        "KV pool: %d blocks of %d tokens (%.2f GiB), host swap %.2f GiB, longest request %s tokens",
        cache.num_blocks,
        cache.block_size,
        cache.num_blocks * core.kv.block_bytes / 2**30,
        cache.swap_space_bytes / 2**30,
        core.max_positions,
    )
    if controller is not None:
        core.attach_controller(controller)
    settings = server_settings(args, name, server_keys, flags.kv_quant_options, flags.default_quant)
    return create_app(core, settings)


def publish_prefixes(args) -> bool:
    """--publish-prefixes: on by default with --replicas (the replicas share prefixes through Redis)."""
    wanted = args.publish_prefixes
    if wanted is None:
        wanted = getattr(args, "replicas", None) is not None and bool(args.redis_url)
    if wanted and not args.redis_url:
        raise ValueError("--publish-prefixes writes computed blocks to Redis: give --redis-url too")
    return bool(wanted)


def served_name(args) -> str:
    """The name clients send as `model`: --served-model-name, else the model directory's name."""
    model_name = model_flag(args)
    return args.served_model_name or (EMBEDDED_NAME if model_name is None else Path(model_name.rstrip("/")).name)


def server_settings(args, name: str, server_keys, kv_quant_options, default_quant):
    """The app's `ServerSettings` from the flags."""
    from kvwise.hf.chat_template import load_chat_template
    from kvwise.server.app import ServerSettings

    return ServerSettings(
        name,
        server_keys.api_keys,
        args.max_queue,
        default_max_tokens=args.default_max_tokens,
        chat_template=load_chat_template(args.chat_template),
        kv_quant_options=kv_quant_options,
        metrics_key=args.metrics_key,
        metrics_per_tenant=args.metrics_per_tenant,
        metrics_max_tenants=args.metrics_max_tenants,
        fair_queue=not args.no_fair_queue,
        body_timeout_seconds=args.body_timeout,
        shared_timing_pad=args.shared_timing_pad,
        default_kv_quant=default_quant,
        log_stats_interval=args.log_stats_interval,
        log_requests=args.log_requests or args.log_request_text,
        log_request_text=args.log_request_text,
    )


def model_flag(args) -> str | None:
    """The model: positional (as vLLM's `serve MODEL`) or --model; both only when they agree."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models: {args.model_tag!r} and --model {args.model!r}; give one")
    return args.model_tag or args.model


def kv_memory_flag(args) -> int | None:
    """Bytes from --kv-cache-memory or --kv-budget-gb (one knob, two spellings), or None."""
    budget = args.kv_cache_memory
    if args.kv_budget_gb is not None:
        if args.kv_budget_gb <= 0:
            raise ValueError(f"--kv-budget-gb must be positive, got {args.kv_budget_gb}")
        gb = int(args.kv_budget_gb * (1 << 30))
        if budget is not None and budget != gb:
            raise ValueError("--kv-cache-memory and --kv-budget-gb are one knob: give one")
        budget = gb
    if budget is not None and budget <= 0:
        raise ValueError(f"--kv-cache-memory must be positive, got {budget}")
    if budget is not None and args.gpu_memory_utilization is not None:
        raise ValueError("give --kv-cache-memory (bytes) or --gpu-memory-utilization (a share), not both")
    if args.num_blocks is not None and (budget is not None or args.gpu_memory_utilization is not None):
        raise ValueError(
            "--num-blocks fixes the pool: leave out --kv-cache-memory, --kv-budget-gb and --gpu-memory-utilization"
        )
    return budget


def size_pool(args, model, cache: CacheConfig, budget: int | None) -> CacheConfig:
    """The pool from --num-blocks, else from KV memory: --kv-cache-memory (pool, swap and quantized
    blocks together), --gpu-memory-utilization (CUDA: device memory for the pool alone), or the
    default (CPU: the smaller of 2 GiB and a quarter of free RAM; CUDA: 0.9 utilization)."""
    from kvwise.engine.kv_budget import cache_config_for_memory

    if args.num_blocks is not None:
        return cache
    utilization = args.gpu_memory_utilization
    if budget is None and utilization is None:
        if model.device.type == "cuda":
            utilization = DEFAULT_GPU_MEMORY_UTILIZATION
        else:
            budget = min(DEFAULT_CPU_KV_MEMORY, _available_memory() // 4)
    swap = None if args.swap_space_gb is None else int(args.swap_space_gb * (1 << 30))
    return cache_config_for_memory(model, cache, budget, utilization, args.max_model_len, swap)


def _available_memory() -> int:
    """Free RAM (Linux's MemAvailable, else what sysconf says is free)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_cache_dtype(args, kv_quant_options) -> str | None:
    """--kv-cache-dtype: the quantizer every request without KV settings of its own stores with."""
    if args.kv_cache_dtype is None:
        return None
    from kvwise.policies.mix import Mix

    if args.kv_policy == "auto":
        raise ValueError("--kv-cache-dtype fixes every request's quantizer: with --kv-policy auto the controller picks")
    name = args.kv_cache_dtype.strip()
    if name in ("auto", "none"):  # vLLM's default spelling: the model's own dtype
        return None
    try:
        spec = Mix(quant=name).quant
    except ValueError as error:
        raise ValueError(f"--kv-cache-dtype: {error}") from None
    if spec not in kv_quant_options:
        enabled = ", ".join(sorted(kv_quant_options)) or "none"
        raise ValueError(
            f"--kv-cache-dtype {name!r} is not among the enabled quantizers ({enabled}; --kv-quant-options)"
        )
    if args.prefix_caching:
        log.warning(
            "--kv-cache-dtype %s: each request stores its own blocks quantized, so requests without KV settings of "
            "their own no longer share prompt blocks through the prefix cache",
            name,
        )
    return spec


def _add_adaptive_flags(parser) -> None:
    """Adaptive KV (--kv-policy auto); `adaptive_config` and `adaptive_controller` read them."""
    adaptive = parser.add_argument_group("adaptive KV (kv-policy auto)")
    adaptive.add_argument(
        "--kv-policy",
        choices=["auto"],
        default=None,
        help="auto: pick each request's KV mix from the model's calibration profile (default: requests' own)",
    )
    adaptive.add_argument(
        "--kv-budget-gb",
        type=float,
        default=None,
        help="all the KV memory to use (pool, host swap, quantized blocks); sizes the pool instead of --num-blocks",
    )
    adaptive.add_argument(
        "--kv-quality", type=float, default=0.98, help="floor on predicted quality vs the full cache, in (0, 1]"
    )
    adaptive.add_argument(
        "--kv-class-mix",
        action="append",
        default=[],
        metavar="CLASS=MIX",
        help="pin a request class to a mix, e.g. retrieval=kvzip@0.75+kivi4 (repeatable)",
    )
    adaptive.add_argument("--kv-profile", default=None, help="a profile JSON (default: the model's, by fingerprint)")
    adaptive.add_argument(
        "--kv-calibrate-on-start",
        action="store_true",
        help="without a profile for the model, run `kvwise calibrate --quick` before serving",
    )


def adaptive_config(args, kv_quant_options):
    """The controller's settings from the flags (errors name the flag), or None without --kv-policy auto."""
    from kvwise.adaptive.controller import AdaptiveConfig

    if args.kv_budget_gb is not None and args.kv_budget_gb <= 0:
        raise ValueError(f"--kv-budget-gb must be positive, got {args.kv_budget_gb}")
    if args.kv_policy != "auto":
        if args.kv_class_mix or args.kv_calibrate_on_start or args.kv_profile:
            raise ValueError("--kv-class-mix, --kv-profile and --kv-calibrate-on-start need --kv-policy auto")
        return None
    pinned = {}
    for item in args.kv_class_mix:
        klass, equals, mix = item.partition("=")
        if not equals:
            raise ValueError(f"--kv-class-mix takes CLASS=MIX, e.g. retrieval=kvzip@0.75+kivi4; got {item!r}")
        pinned[klass.strip()] = mix.strip()
    try:
        return AdaptiveConfig(
            args.kv_quality,
            allowed_quants=tuple(kv_quant_options),
            class_mix=pinned,
        )
    except ValueError as error:
        flag = "--kv-quality" if "quality" in str(error) else "--kv-class-mix"
        raise ValueError(f"{flag}: {error}") from None


def adaptive_controller(args, config, model, tokenizer):
    """The controller on the model's profile; without one, --kv-calibrate-on-start makes it (quick)."""
    from kvwise.adaptive.factory import build_adaptive_controller

    return build_adaptive_controller(
        model,
        config=config,
        profile_path=args.kv_profile,
        tokenizer=tokenizer,
        calibrate_on_start=args.kv_calibrate_on_start,
    )


def _add_tier_flags(parser) -> None:
    """Where evicted prefix blocks spill (host RAM, disk, Redis), and their keys; `prefix_tiers` builds them."""
    parser.add_argument("--host-cache-gb", type=float, default=0.0, help="host RAM for evicted prefix blocks (0: none)")
    parser.add_argument("--disk-cache", default=None, help="directory for evicted prefix blocks, below host RAM")
    parser.add_argument(
        "--disk-key-file",
        default=None,
        help="hex AES-256 key(s) encrypting and authenticating --disk-cache files, first line encrypting "
        "(or KVWISE_DISK_KEY)",
    )
    parser.add_argument("--disk-cache-gb", type=float, default=None, help="bound on --disk-cache (default: none)")
    parser.add_argument(
        "--redis-url",
        default=None,
        help="Redis for evicted prefix blocks, last tier (redis://, rediss:// for TLS, user:password@ for ACL "
        "users; redis+cluster://host:port for a Redis Cluster, any node)",
    )
    parser.add_argument(
        "--redis-key-prefix",
        default="kvwise:block:",
        help="the start of every Redis key this server writes (deployments sharing one Redis keep apart)",
    )
    parser.add_argument(
        "--publish-prefixes",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write newly computed prefix blocks to --redis-url at once, for other servers to reuse "
        "(default: on with --replicas, else off)",
    )
    parser.add_argument(
        "--redis-hmac-key-file",
        default=None,
        help="hex key(s) authenticating Redis entries, first line signing (or KVWISE_REDIS_HMAC_KEY)",
    )
    parser.add_argument(
        "--redis-key-file",
        default=None,
        help="hex AES-256 key(s) encrypting Redis entries, first line encrypting (or KVWISE_REDIS_KEY)",
    )


def prefix_tiers(args, keys=None) -> list:
    """The tiers under the prefix cache, fastest first: host RAM, disk, Redis (each optional).
    keys: the server's `ServerKeys`. Disk files are MAC'd with keys derived from the namespace
    keys, and encrypted with --disk-key-file (or KVWISE_DISK_KEY) when one is given; Redis entries
    are MAC'd with --redis-hmac-key-file (or KVWISE_REDIS_HMAC_KEY) and encrypted with
    --redis-key-file (or KVWISE_REDIS_KEY)."""
    tiers = []
    if not args.host_cache_gb >= 0 or (args.disk_cache_gb is not None and not args.disk_cache_gb > 0):  # NaN too
        raise ValueError("--host-cache-gb must be >= 0 and --disk-cache-gb > 0")
    if args.disk_cache_gb is not None and not args.disk_cache:
        raise ValueError("--disk-cache-gb bounds --disk-cache DIR: give the directory too")
    if (args.host_cache_gb or args.disk_cache or args.redis_url) and not args.prefix_caching:
        raise ValueError("--host-cache-gb, --disk-cache and --redis-url hold prefix blocks: drop --no-prefix-caching")
    if args.host_cache_gb:
        from kvwise.tiers.host import HostTier

        tiers.append(HostTier(int(args.host_cache_gb * (1 << 30))))
    if args.disk_cache:
        from kvwise.tiers.disk import DiskTier

        capacity = None if args.disk_cache_gb is None else int(args.disk_cache_gb * (1 << 30))
        mac_keys = keys.disk_mac if keys is not None else None
        encryption_keys = keys.disk_encryption if keys is not None else None
        disk = DiskTier(args.disk_cache, capacity, encryption_key=encryption_keys, mac_key=mac_keys)
        if not disk.encrypted:
            log.warning(
                "the disk tier at %s stores KV in plaintext: anyone who can read the folder can read cached "
                "prompts' KV; give --disk-key-file (or KVWISE_DISK_KEY) to encrypt it",
                args.disk_cache,
            )
        tiers.append(disk)
    if args.redis_url:
        from kvwise.tiers.redis_tier import RedisTier

        hmac_keys = keys.redis_hmac if keys is not None else None
        encryption_keys = keys.redis_encryption if keys is not None else None
        tiers.append(
            RedisTier(args.redis_url, hmac_key=hmac_keys, encryption_key=encryption_keys, prefix=args.redis_key_prefix)
        )
    return tiers


def run_server(args) -> None:
    import uvicorn

    from kvwise.server.slow_clients import header_timeout_protocol

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM/SIGINT once it has shut down, so the process would end as killed
        by the signal; after a graceful drain, `kvwise serve` exits 0 instead."""

        def handle_exit(self, sig, frame):
            app.state.engine.accepting = False  # requests on open keep-alive connections get 503
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    getattr(self, "_captured_signals", []).clear()

    from kvwise.server.key_files import install_key_reload

    # before the model loads: what loading and sizing the pool log is seen
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app = build_app(args)
    install_key_reload(app, args)
    print(f"kvwise: serving on http://{args.host}:{args.port}/v1 (Ctrl-C stops after running requests finish)")
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
        http=header_timeout_protocol(args.header_timeout),
    )
    GracefulServer(config).run()
