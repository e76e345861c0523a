"""Start throwaway redis-server processes on 127.0.0.1, one node or a cluster, for the tests (not
part of the package: a deployment, or `kvwise bench reuse --redis-url`, brings its own Redis)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def free_port(below: int = 65536) -> int:
    """A free local port under `below` (a cluster node also listens on port + 10000)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port < below:
            return port


def redis_binary(name: str = "redis-server") -> str:
    binary = shutil.which(name)
    if binary is None:
        raise RuntimeError(f"{name} is not installed (apt-get install redis-server)")
    return binary


@dataclass
class RedisProcess:
    port: int
    process: subprocess.Popen
    command: list[str] | None = None  # how it was started: `restart` starts it again, same port and folder

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL: a node that dies, not one shut down."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def restart(self) -> None:
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_ping(self.port, self.process)


def start_redis(directory: Path, *extra: str) -> RedisProcess:
    """A redis-server with persistence off, answering PING; RuntimeError if it does not start."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port(below=55000 if "--cluster-enabled" in extra else 65536)
    command = [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    command = [*command, "--dir", str(directory), *extra]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_ping(port, process)
    return RedisProcess(port, process, command)


def _wait_for_ping(port: int, process: subprocess.Popen) -> None:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
    for _ in range(100):
        try:
            if client.ping():
                return
        except redis.ConnectionError:
            time.sleep(0.05)
    process.terminate()
    raise RuntimeError(f"redis-server did not start on port {port}")


def start_cluster(directory: Path, nodes: int = 3, replicas: int = 0) -> list[RedisProcess]:
    """`nodes` cluster-enabled servers joined into one cluster, `replicas` replicas per master
    (3 nodes and 0: three masters; 6 and 1: three masters with a replica each), state ok."""
    import redis

    servers = [
        start_redis(directory / f"node{index}", "--cluster-enabled", "yes", "--cluster-node-timeout", "2000")
        for index in range(nodes)
    ]
    addresses = [f"127.0.0.1:{server.port}" for server in servers]
    subprocess.run(
        [redis_binary("redis-cli"), "--cluster", "create", *addresses, "--cluster-replicas", str(replicas)]
        + ["--cluster-yes"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=30,
    )
    for server in servers:
        client = redis.Redis(host="127.0.0.1", port=server.port)
        for _ in range(200):
            if cluster_ok(client):
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("the Redis cluster did not reach state ok")
    return servers


def cluster_ok(client) -> bool:
    import redis

    try:
        return client.cluster("info").get("cluster_state") == "ok"
    except redis.RedisError:
        return False


def masters(servers: list[RedisProcess]) -> list[RedisProcess]:
    """The nodes that are masters now."""
    import redis

    found = []
    for server in servers:
        try:
            if redis.Redis(host="127.0.0.1", port=server.port).info("replication")["role"] == "master":
                found.append(server)
        except redis.RedisError:
            continue
    return found
