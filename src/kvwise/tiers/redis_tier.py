"""Redis tier: blocks as binary values with an HMAC tag and a TTL, on one Redis or a cluster.

Value: HMAC-SHA256(hmac_key, redis key || payload) || payload, where payload is the block format
of `tiers.payload`. An entry written by anyone without the key, or altered, fails the tag and
is deleted and counted; the caller recomputes. The Redis key is `prefix + block key (hex)`, and
block keys already carry the tenant's salt, so tenants never read each other's entries.

Redis being down never fails a request: every call catches redis errors, counts them in
`stats.errors`, and answers as a miss (get) or a refused write (put).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time

import torch

from kvwise.tiers.base import Tier
from kvwise.tiers.payload import CorruptBlock, decode_block, encode_block

HMAC_ENVIRONMENT = "KVWISE_REDIS_HMAC_KEY"
TAG_BYTES = 32


class RedisTier(Tier):
    """Args:
    url: "redis://host:port/db" (for a cluster, any node's "redis://host:port").
    hmac_key: bytes, or a string; default from KVWISE_REDIS_HMAC_KEY. Required.
    ttl_seconds: how long an entry lives.
    cluster: use redis-py's RedisCluster client.
    """

    name = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        hmac_key: bytes | str | None = None,
        ttl_seconds: int = 3600,
        cluster: bool = False,
        prefix: str = "kvwise:block:",
        timeout_seconds: float = 0.5,
        retry_seconds: float = 5.0,
    ):
        super().__init__()
        hmac_key = hmac_key if hmac_key is not None else os.environ.get(HMAC_ENVIRONMENT)
        if not hmac_key:
            raise ValueError(f"the Redis tier needs an HMAC key: pass hmac_key= or set {HMAC_ENVIRONMENT}")
        if ttl_seconds < 1:
            raise ValueError(f"ttl_seconds must be >= 1, got {ttl_seconds}")
        self._hmac_key = hmac_key.encode() if isinstance(hmac_key, str) else bytes(hmac_key)
        self.ttl_seconds, self.prefix = ttl_seconds, prefix
        self.last_error: str | None = None
        # after a failure, calls fail fast for retry_seconds: the engine spills on its own thread
        # at every eviction, and must not wait out a timeout per block while Redis is down
        self.retry_seconds, self._down_until = retry_seconds, 0.0
        import redis

        self._errors = (redis.RedisError, OSError)
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # No retries: redis-py's default (several, with back-off up to a second) would run on the
        # engine thread and stall every request while Redis is down; one timeout, then the
        # fail-fast window above.
        options = {
            "socket_timeout": timeout_seconds,
            "socket_connect_timeout": timeout_seconds,
            "retry": Retry(NoBackoff(), 0),
        }
        if cluster:
            from redis.cluster import RedisCluster

            self.client = RedisCluster.from_url(url, **options)
        else:
            self.client = redis.Redis.from_url(url, retry_on_timeout=False, **options)

    def _name(self, key: bytes) -> bytes:
        return self.prefix.encode() + key.hex().encode()

    def _tag(self, name: bytes, payload: bytes) -> bytes:
        return hmac.new(self._hmac_key, name + payload, hashlib.sha256).digest()

    def _failed(self, error: Exception) -> None:
        self.stats.errors += 1
        self.last_error = f"{type(error).__name__}: {error}"
        self._down_until = time.monotonic() + self.retry_seconds

    def _resting(self) -> bool:
        """True (and counted as an error) while a recent failure says Redis is down."""
        if time.monotonic() < self._down_until:
            self.stats.errors += 1
            return True
        return False

    def put(self, key: bytes, block: torch.Tensor) -> bool:
        if self._resting():
            self.stats.refused_puts += 1
            return False
        name = self._name(key)
        payload = encode_block(key, block)
        try:
            self.client.set(name, self._tag(name, payload) + payload, ex=self.ttl_seconds)
        except self._errors as error:
            self._failed(error)
            self.stats.refused_puts += 1
            return False
        self.stats.puts += 1
        return True

    def get(self, key: bytes) -> torch.Tensor | None:
        self.stats.gets += 1
        if self._resting():
            return None
        name = self._name(key)
        try:
            value = self.client.get(name)
        except self._errors as error:
            self._failed(error)
            return None
        if value is None:
            return None
        tag, payload = value[:TAG_BYTES], value[TAG_BYTES:]
        try:
            if not hmac.compare_digest(tag, self._tag(name, payload)):
                raise CorruptBlock("HMAC tag mismatch")
            block = decode_block(key, payload)
        except CorruptBlock:
            self.stats.corrupt += 1
            self.delete(key)
            return None
        self.stats.hits += 1
        return block

    def exists(self, key: bytes) -> bool:
        if self._resting():
            return False
        try:
            return bool(self.client.exists(self._name(key)))
        except self._errors as error:
            self._failed(error)
            return False

    def delete(self, key: bytes) -> None:
        if self._resting():
            return
        try:
            self.client.delete(self._name(key))
            self.stats.deletes += 1
        except self._errors as error:
            self._failed(error)
