"""`kvwise serve --replicas N`: engine replicas as a Ray Serve deployment, behind kvwise's ingress.

    cluster = deploy(args, replicas=2)          # starts a local Ray unless args.ray_address
    ... cluster.app is the ingress (an ASGI app) ...
    cluster.shutdown()                          # stops Ray only if deploy started it

Each replica loads the model and sizes its own KV memory (`--kv-cache-memory` is per replica;
the default on CPU splits a quarter of free RAM between them). Every replica gets the ingress's
keys, so block names, API keys and Redis entries agree across replicas on any node.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvwise.server.serve import check_flags
from kvwise.util.extras import require

log = logging.getLogger("kvwise.cluster")

APP_NAME = "kvwise"
DEPLOYMENT_NAME = "kvwise-engine"
GIB = 1 << 30


@dataclass
class Cluster:
    app: object  # the ingress's ASGI app
    handle: object  # the engine deployment's handle
    replicas: int
    started_ray: bool
    ingress: object = None
    _closed: bool = field(default=False, repr=False)

    def shutdown(self) -> None:
        """Remove the deployment; stop Serve and Ray when this process started them."""
        if self._closed:
            return
        self._closed = True
        import ray
        from ray import serve

        try:
            if self.started_ray:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            if self.started_ray:
                ray.shutdown()


def deploy(
    args,
    replicas: int,
    router: str = "kvwise",
    ray_address: str | None = None,
    stats_period: float = 1.0,
    local_cpus: int | None = None,
    object_store_bytes: int = 256 << 20,
) -> Cluster:
    """Check the replicas fit, start or join Ray, deploy the replicas and build the ingress."""
    require("ray.serve", "cluster", "kvwise serve --replicas")
    from kvwise.cluster.routers import ROUTERS

    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; choose one of: {', '.join(ROUTERS)}")
    replica_args = per_replica_args(args, replicas)
    keys = cluster_keys(replica_args)
    # here, once: a replica that cannot start is retried by Ray, not reported (a Redis Cluster URL
    # is connected to, to read its slots)
    check_flags(replica_args, keys)
    if ray_address is None:
        check_fits(replica_args, replicas, _available_memory())
    import ray

    started_ray = False
    if not ray.is_initialized():
        if ray_address is None:
            cpus = local_cpus or max(os.cpu_count() or 1, replicas)
            ray.init(
                num_cpus=cpus,
                include_dashboard=False,
                object_store_memory=object_store_bytes,
                log_to_driver=True,
                configure_logging=False,
            )
            started_ray = True
        else:
            ray.init(address=ray_address, log_to_driver=False)
            memory = ray.available_resources().get("memory")
            if memory:
                check_fits(replica_args, replicas, int(memory))
    try:
        handle = _deploy(replica_args, keys, replicas, router, stats_period, started_ray)
        ingress = _ingress(args, handle, replica_args, keys)
    except BaseException:
        if started_ray:
            from ray import serve

            serve.shutdown()
            ray.shutdown()
        raise
    from kvwise.cluster.ingress import create_ingress_app

    return Cluster(create_ingress_app(ingress), handle, replicas, started_ray, ingress)


def cluster_keys(args):
    """The server's keys, read once here; Redis keys given only through the environment are
    carried too, so replicas on other nodes need neither key files nor variables."""
    from kvwise.server.key_files import read_server_keys
    from kvwise.tiers.redis_tier import HMAC_ENVIRONMENT, KEY_ENVIRONMENT

    keys = read_server_keys(args)
    if keys.redis_hmac is None and os.environ.get(HMAC_ENVIRONMENT):
        keys = dataclasses.replace(keys, redis_hmac=[os.environ[HMAC_ENVIRONMENT]])
    if keys.redis_encryption is None and os.environ.get(KEY_ENVIRONMENT):
        encryption = [key for key in os.environ[KEY_ENVIRONMENT].split(",") if key.strip()]
        keys = dataclasses.replace(keys, redis_encryption=encryption)
    return keys


def _deploy(replica_args, keys, replicas: int, router: str, stats_period: float, local: bool):
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.schema import LoggingConfig

    from kvwise.cluster.replica import EngineReplica
    from kvwise.cluster.routers import ROUTERS

    cores = os.cpu_count() or 1
    threads = max(1, cores // replicas) if local else None
    cpus = min(1.0, cores / replicas) if local else 1.0
    serve.start(proxy_location="Disabled")  # the ingress is kvwise's own: Ray's HTTP proxy is not needed
    deployment = serve.deployment(EngineReplica, name=DEPLOYMENT_NAME).options(
        num_replicas=replicas,
        max_ongoing_requests=replica_args.max_queue + replica_args.max_running,
        # beyond what every replica queues, the front door answers 503 instead of holding requests
        max_queued_requests=replica_args.max_queue * replicas,
        ray_actor_options={"num_cpus": cpus, "num_gpus": getattr(replica_args, "replica_gpus", 0) or 0},
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[router],
            request_router_kwargs={"block_size": replica_args.block_size} if router == "kvwise" else {},
            request_routing_stats_period_s=stats_period,
            request_routing_stats_timeout_s=max(5.0, 3 * stats_period),
        ),
    )
    log.info("starting %d engine replicas on Ray Serve (router: %s)", replicas, router)
    logging_config = LoggingConfig(log_level=replica_args.log_level.upper(), enable_access_log=False)
    return serve.run(
        deployment.bind(replica_args, keys, threads), name=APP_NAME, route_prefix=None, logging_config=logging_config
    )


def _ingress(args, handle, replica_args, keys):
    from kvwise.cluster.ingress import Ingress
    from kvwise.cluster.routed_request import PromptEncoder, RoutingKeys
    from kvwise.cluster.router_registry import ACTIVE_ROUTERS
    from kvwise.models import load_tokenizer
    from kvwise.server.app import RequestHandlers
    from kvwise.server.kv_fields import parse_kv_quant_options
    from kvwise.server.serve import kv_cache_dtype, model_flag, served_name, server_settings

    described = handle.describe.remote().result(timeout_s=600)
    options = parse_kv_quant_options(args.kv_quant_options)
    settings = server_settings(args, served_name(args), keys, options, kv_cache_dtype(args, options))
    encoder = PromptEncoder(load_tokenizer(model_flag(args)), described["vocab_size"], described["max_positions"])
    handlers = RequestHandlers(encoder, None, settings)
    routing_keys = RoutingKeys(handlers, described["key_space"], keys.namespace[0])
    attempts = replica_args.replicas + 1
    return Ingress(handle, handlers, routing_keys, lambda: ACTIVE_ROUTERS.get(DEPLOYMENT_NAME), attempts)


def per_replica_args(args, replicas: int) -> argparse.Namespace:
    """The flags each replica builds its server from: KV memory per replica (the CPU default
    splits a quarter of free RAM among them), nothing that cannot travel to another process."""
    from kvwise.server.serve import DEFAULT_CPU_KV_MEMORY

    copied = argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})
    copied.replicas = replicas
    on_cpu = args.device == "cpu" or (args.device == "auto" and not _cuda())
    memory_flags = (args.kv_cache_memory, args.kv_budget_gb, args.num_blocks, args.gpu_memory_utilization)
    if on_cpu and all(flag is None for flag in memory_flags):
        copied.kv_cache_memory = min(DEFAULT_CPU_KV_MEMORY, _available_memory() // (4 * replicas))
    return copied


def check_fits(args, replicas: int, available: int) -> None:
    """Refuse, before anything starts, more replicas than `available` bytes hold: each needs its
    weights and its KV memory."""
    weights = estimate_weights_bytes(args)
    kv = args.kv_cache_memory or (int(args.kv_budget_gb * GIB) if args.kv_budget_gb else 0)
    need = replicas * (weights + kv)
    if need > available:
        raise ValueError(
            f"{replicas} replicas need about {need / GIB:.1f} GiB ({weights / GIB:.2f} GiB of weights and "
            f"{kv / GIB:.2f} GiB of KV memory each), but {available / GIB:.1f} GiB is available: "
            "run fewer replicas, or give each less --kv-cache-memory"
        )


def estimate_weights_bytes(args) -> int:
    """The model's weights in memory: its weight files' size (the embedded GGUF's dequantized
    copy, ~0.5 GiB in float32), doubled when 16-bit files load as float32 on CPU."""
    from kvwise.server.serve import model_flag

    name = model_flag(args)
    if name is None:
        return 540 << 20  # SmolLM2-135M in float32
    folder = Path(name)
    if not folder.is_dir():
        return 0  # a hub id: not known before loading
    files = [path for path in folder.iterdir() if path.suffix in (".safetensors", ".bin", ".pt")]
    size = sum(path.stat().st_size for path in files)
    sixteen_bit = (
        any(dtype in (folder / "config.json").read_text() for dtype in ("bfloat16", "float16"))
        if (folder / "config.json").is_file()
        else False
    )
    return size * 2 if sixteen_bit and (args.dtype in (None, "float32")) and not _cuda() else size


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _available_memory() -> int:
    from kvwise.server.serve import _available_memory as available

    return available()


def run_cluster(args) -> None:
    """Serve the ingress with uvicorn until SIGINT/SIGTERM, then take the deployment down."""
    import uvicorn

    from kvwise.server.slow_clients import header_timeout_protocol

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    cluster = deploy(args, args.replicas, router=args.router, ray_address=args.ray_address)
    try:
        print(
            f"kvwise: serving {args.replicas} replicas on http://{args.host}:{args.port}/v1 "
            f"(router: {args.router}; Ctrl-C stops)"
        )
        config = uvicorn.Config(
            cluster.app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.shutdown_timeout,
            http=header_timeout_protocol(args.header_timeout),
        )
        uvicorn.Server(config).run()
    finally:
        cluster.shutdown()
