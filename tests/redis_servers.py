"""Real redis-server processes for the tests; a missing binary fails loudly (CI installs it)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests import redis_launcher as local_redis


def start_redis(directory: Path, *extra: str) -> local_redis.RedisProcess:
    try:
        return local_redis.start_redis(directory, *extra)
    except RuntimeError as error:
        pytest.fail(f"{error}; `make test` and .ci/run install redis-server with apt-get")


def start_cluster(directory: Path, nodes: int = 3, replicas: int = 0) -> list[local_redis.RedisProcess]:
    try:
        return local_redis.start_cluster(directory, nodes, replicas)
    except RuntimeError as error:
        pytest.fail(f"{error}; `make test` and .ci/run install redis-server with apt-get")


def start_redis_on(directory: Path, port: int, *extra: str, **client_options) -> local_redis.RedisProcess:
    """A redis-server on a chosen port (a restart after a kill), with AUTH or TLS in `extra`:
    ready once a client made with `client_options` (password, username, ssl_*) answers PING."""
    import redis

    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "redis.log"
    command = [local_redis.redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    with log.open("ab") as output:
        process = subprocess.Popen(
            [*command, "--appendonly", "no", "--dir", str(directory), *extra], stdout=output, stderr=output
        )
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2, socket_timeout=1, **client_options)
    for _ in range(200):
        if process.poll() is not None:
            break
        try:
            if client.ping():
                return local_redis.RedisProcess(port, process)
        except redis.ConnectionError:
            time.sleep(0.05)
    process.kill()
    process.wait()
    pytest.fail(f"redis-server did not start on port {port}: {log.read_text(errors='replace')[-800:]}")


def tls_unsupported_reason(directory: Path) -> str | None:
    """Why this redis-server cannot serve TLS, or None. Only a build with TLS tries to load the
    certificate files it is given, so missing files tell the builds apart without a handshake."""
    missing = str(directory / "missing.pem")
    tls = ["--tls-cert-file", missing, "--tls-key-file", missing, "--tls-ca-cert-file", missing]
    command = [local_redis.redis_binary(), "--port", "0", "--tls-port", str(local_redis.free_port()), *tls]
    try:
        result = subprocess.run([*command, "--save", ""], capture_output=True, text=True, timeout=5)
    except subprocess.TimeoutExpired:  # it ignored the TLS options and kept serving
        return "redis-server ignores --tls-port: built without TLS"
    if "TLS" in result.stdout and ("certificate" in result.stdout or "Failed to configure" in result.stdout):
        return None
    return f"redis-server cannot serve TLS: {(result.stdout + result.stderr).strip()[-300:]}"
