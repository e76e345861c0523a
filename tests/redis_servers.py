"""Real redis-server processes for the tests; a missing binary fails loudly (CI installs it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvwise.tiers import local_redis


def start_redis(directory: Path, *extra: str) -> local_redis.RedisProcess:
    try:
        return local_redis.start_redis(directory, *extra)
    except RuntimeError as error:
        pytest.fail(f"{error}; `make test` and .ci/run install redis-server with apt-get")


def start_cluster(directory: Path, nodes: int = 3) -> list[local_redis.RedisProcess]:
    try:
        return local_redis.start_cluster(directory, nodes)
    except RuntimeError as error:
        pytest.fail(f"{error}; `make test` and .ci/run install redis-server with apt-get")
