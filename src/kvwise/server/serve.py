"""`kvwise serve`: load the model, build the engine and run the app under uvicorn.

SIGINT/SIGTERM shut down gracefully: uvicorn stops accepting connections and waits for open
ones (streams included) for up to --shutdown-timeout seconds, then the engine drains.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from kvwise.engine.config import CacheConfig

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
log = logging.getLogger("kvwise.server")


def add_serve_arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="HF hub id or local directory (default: embedded SmolLM2)")
    parser.add_argument("--served-model-name", default=None, help="the name clients send as `model`")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-keys", default=None, help="file of `KEY TENANT [shared]` lines; none: no auth")
    parser.add_argument("--max-queue", type=int, default=256, help="waiting requests before answering 429")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: per device)")
    parser.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    parser.add_argument("--num-blocks", type=int, default=CacheConfig.num_blocks)
    parser.add_argument("--token-budget", type=int, default=CacheConfig.token_budget)
    parser.add_argument("--max-running", type=int, default=CacheConfig.max_running)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--swap-space-gb", type=float, default=4.0, help="host memory for preempted requests' KV")
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
        help="Redis for evicted prefix blocks, last tier (redis://, rediss:// for TLS, user:password@ for ACL users)",
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


def build_app(args):
    """The app for parsed `serve` arguments (also used by tests, without uvicorn's CLI)."""
    from kvwise.engine.core import EngineCore
    from kvwise.hf.chat_template import load_chat_template
    from kvwise.models import load_model
    from kvwise.server.app import ServerSettings, create_app, parse_kv_quant_options
    from kvwise.server.key_files import read_server_keys

    server_keys = read_server_keys(args)
    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    cache = CacheConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        token_budget=args.token_budget,
        max_running=args.max_running,
        prefix_caching=not args.no_prefix_caching,
        swap_space_bytes=int(args.swap_space_gb * (1 << 30)),
        prefix_quota_blocks=args.prefix_quota_blocks,
        fair_prefix_shares=not args.no_fair_prefix_shares,
    )
    kv_quant_options = parse_kv_quant_options(args.kv_quant_options)
    adaptive = adaptive_config(args, kv_quant_options)  # flags checked before the model loads
    tiers = prefix_tiers(args, server_keys)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    name = args.served_model_name or (EMBEDDED_NAME if args.model is None else Path(args.model.rstrip("/")).name)
    if args.kv_budget_gb is not None:
        from kvwise.engine.kv_budget import cache_config_for_budget

        cache = cache_config_for_budget(model, int(args.kv_budget_gb * (1 << 30)), cache)
    controller = adaptive_controller(args, adaptive, model, tokenizer) if adaptive is not None else None
    core = EngineCore(model, tokenizer, cache, tiers, namespace_key=server_keys.namespace)
    if controller is not None:
        core.attach_controller(controller)
    settings = ServerSettings(
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
    )
    return create_app(core, settings)


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
    from kvwise.adaptive.controller import AdaptiveController
    from kvwise.adaptive.profile import require_profile

    try:
        profile = require_profile(model, args.kv_profile)
    except ValueError:
        if not args.kv_calibrate_on_start or args.kv_profile is not None:
            raise
        from kvwise.adaptive.calibrate import CalibrateConfig, run_calibrate

        log.warning("no KV profile for this model: calibrating (--quick) before serving")
        run_calibrate(CalibrateConfig(quick=True), model=(model, tokenizer))
        profile = require_profile(model)
    return AdaptiveController(profile, config)


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
    if (args.host_cache_gb or args.disk_cache or args.redis_url) and args.no_prefix_caching:
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
        tiers.append(RedisTier(args.redis_url, hmac_key=hmac_keys, encryption_key=encryption_keys))
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

    app = build_app(args)
    install_key_reload(app, args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
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
