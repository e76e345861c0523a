"""Redis tier: blocks as binary values, authenticated (keyed BLAKE3 or AES-256-GCM), with a TTL.

The Redis key is `prefix + block key (hex)`. Block keys are keyed hashes of a secret namespace
(server secret, tenant, weights fingerprint), so tenants never read each other's entries, entries
of other weights are never asked for, and a listing of the keys confirms no guessed prompt. The
value is the block format of `tiers.payload`, sealed one of two ways:

- HMAC only:  BLAKE3-keyed(hmac key, redis key || payload) || payload
- encrypted:  nonce (12 bytes) || AES-256-GCM(encryption key, payload, associated data = redis key)

Both bind the value to its Redis key, so a value copied under another name, altered, truncated,
or written by anyone without the key fails, is deleted and counted in `stats.corrupt`; the caller
recomputes. With encryption the GCM tag is the MAC: it authenticates the ciphertext and the key
name (which carries the namespace and the weights fingerprint) under a 256-bit key, so an HMAC on
top would cost a second pass over every block on the engine thread and add nothing. The HMAC keys
are then not used, and only the encryption keys are required. Entries of the other format (after
turning encryption on or off) are corrupt misses; the cache refills.

Keys rotate without a restart: `hmac_key` and `encryption_key` take one key or a list, the first
seals new values and every one opens old ones, and `set_keys` swaps them while the engine runs.
With several servers on one Redis, rotate in two rounds, or each server would count and delete
the others' new entries: first add the new key last everywhere ([old, new]), then put it first
([new, old]), and drop the old one once its entries have aged out (ttl_seconds).

Connection security comes from the URL, as redis-py reads it: `redis://user:password@host:port/0`
for AUTH and ACL users, and `rediss://...?ssl_ca_certs=ca.pem` (plus `ssl_certfile`/`ssl_keyfile`
for client certificates) for TLS; tests/test_redis_auth_tls.py runs each against a real server.

A Redis Cluster is asked for with `cluster=True` or a `redis+cluster://` (`rediss+cluster://`)
URL naming any node. A server that cannot reach Redis at startup serves without it and connects
at a later call, once `retry_seconds` have passed.

Redis being down never fails a request: every call catches redis errors, counts them in
`stats.errors`, and answers as a miss (get) or a refused write (put), after at most one socket
timeout: redis-py's retries are off, and a failure makes calls fail fast for `retry_seconds`
(keep it well above an engine step, so one step meets at most one timeout). Whatever bytes Redis
holds under a key, including a value of another type, `get` returns a block or None.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import blake3
import torch

from kvwise.tiers.base import Tier
from kvwise.tiers.payload import CorruptBlock, decode_block, encode_block
from kvwise.util.extras import require

log = logging.getLogger("kvwise.tiers")
HMAC_ENVIRONMENT = "KVWISE_REDIS_HMAC_KEY"
KEY_ENVIRONMENT = "KVWISE_REDIS_KEY"  # hex; several, comma-separated, during a rotation
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
TAG_BYTES = 32
NONCE_BYTES = 12

KeyOrKeys = bytes | str | Sequence[bytes | str] | None


@dataclass(frozen=True, repr=False)  # no repr: keys never reach a log or a traceback
class SealingKeys:
    """The keys in force: the first of each tuple seals, all open. Replaced whole by `set_keys`,
    so a call on another thread sees the old set or the new one, never a mix."""

    hmac_keys: tuple[bytes, ...]
    encryption_keys: tuple[bytes, ...]
    ciphers: tuple  # one AESGCM per encryption key

    @classmethod
    def parse(cls, hmac_keys: KeyOrKeys, encryption_keys: KeyOrKeys) -> SealingKeys:
        macs = tuple(key.encode() if isinstance(key, str) else bytes(key) for key in _as_list(hmac_keys))
        aes_keys = tuple(_encryption_key(key) for key in _as_list(encryption_keys))
        if not macs and not aes_keys:
            raise ValueError(
                "the Redis tier needs an HMAC key or an encryption key: pass hmac_key= or encryption_key=, "
                f"or set {HMAC_ENVIRONMENT} or {KEY_ENVIRONMENT}"
            )
        if not all(macs):
            raise ValueError("an HMAC key of the Redis tier is empty")
        if not aes_keys:
            return cls(macs, aes_keys, ())
        aead = require("cryptography.hazmat.primitives.ciphers.aead", "crypto", "an encrypted Redis tier")
        return cls(macs, aes_keys, tuple(aead.AESGCM(key) for key in aes_keys))


def _as_list(keys: KeyOrKeys) -> list:
    """One key, a list of keys, or none; an empty string counts as none (an unset variable)."""
    if keys is None or (isinstance(keys, str | bytes | bytearray) and not keys):
        return []
    return [keys] if isinstance(keys, str | bytes | bytearray) else list(keys)


def _encryption_key(key: bytes | str) -> bytes:
    if isinstance(key, str):
        try:
            key = bytes.fromhex(key.strip())
        except ValueError:
            raise ValueError(f"a Redis encryption key must be hex (as in {KEY_ENVIRONMENT})") from None
    if len(key) != 32:
        raise ValueError(f"a Redis encryption key must be 32 bytes (AES-256), got {len(key)}")
    return bytes(key)


def _tag(hmac_key: bytes, name: bytes, payload: bytes) -> bytes:
    """Keyed BLAKE3 (a MAC at several GB/s: a restore is not held up verifying it) over the Redis
    key, then the payload, without copying the block onto the name."""
    mac = blake3.blake3(key=_tag_key(hmac_key))
    mac.update(name)
    mac.update(payload)
    return mac.digest(TAG_BYTES)


@lru_cache(maxsize=16)
def _tag_key(hmac_key: bytes) -> bytes:
    """BLAKE3's keyed mode takes 32 bytes: derived from a key of any length."""
    return blake3.blake3(hmac_key, derive_key_context="kvwise redis entry MAC 2026-12").digest()


class RedisTier(Tier):
    """Args:
    url: "redis://[user:password@]host:port/db", or "rediss://..." for TLS; for a cluster, any
        node's URL, as "redis+cluster://host:port" (or with cluster=True).
    hmac_key: one key (bytes, or a string used as UTF-8) or a list; default from
        KVWISE_REDIS_HMAC_KEY. Required unless an encryption key is given.
    encryption_key: one AES-256 key (32 bytes, or hex) or a list; default from KVWISE_REDIS_KEY
        (hex, comma-separated for a list). With it, values are encrypted.
    ttl_seconds: how long an entry lives.
    cluster: use redis-py's RedisCluster client (implied by a `+cluster` scheme).
    timeout_seconds: the socket timeout, the longest one call waits.
    retry_seconds: after a failure, calls answer at once (a miss) for this long.
    """

    name = "redis"
    shared = True  # other servers read what this one writes: newly computed blocks may be published

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        hmac_key: KeyOrKeys = None,
        ttl_seconds: int = 3600,
        cluster: bool = False,
        prefix: str = "kvwise:block:",
        timeout_seconds: float = 0.5,
        retry_seconds: float = 5.0,
        encryption_key: KeyOrKeys = None,
    ):
        super().__init__()
        if hmac_key is None:
            hmac_key = os.environ.get(HMAC_ENVIRONMENT)
        if encryption_key is None:
            encryption_key = [key for key in os.environ.get(KEY_ENVIRONMENT, "").split(",") if key.strip()]
        if ttl_seconds < 1:
            raise ValueError(f"ttl_seconds must be >= 1, got {ttl_seconds}")
        self.set_keys(hmac_key, encryption_key)
        self.ttl_seconds, self.prefix = ttl_seconds, prefix
        self.last_error: str | None = None
        # after a failure, calls fail fast for retry_seconds: the engine spills on its own thread
        # at every eviction, and must not wait out a timeout per block while Redis is down
        self.retry_seconds, self._down_until = retry_seconds, 0.0
        self._up = True  # for the log: one line when Redis goes down, one when it is back
        redis = require("redis", "redis", "the Redis tier")
        # RedisClusterException: no node of a cluster answered (it is no RedisError)
        self._errors = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)
        self._response_error = redis.ResponseError
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
        scheme, separator, rest = url.partition("://")
        if separator and scheme.lower() in CLUSTER_SCHEMES:
            url, cluster = f"{CLUSTER_SCHEMES[scheme.lower()]}://{rest}", True
        self.cluster = cluster
        if cluster:
            from redis.cluster import RedisCluster

            # RedisCluster reads the slot map when built: a cluster that is down at startup is
            # connected to later (`_connected`), and the server serves without it meanwhile
            self._connect = lambda: RedisCluster.from_url(url, **options)
            self.client = None
            self._connected()
        else:
            self.client = redis.Redis.from_url(url, retry_on_timeout=False, **options)

    def _connected(self) -> bool:
        """Whether there is a client; builds one when there is none and the retry window is over."""
        if self.client is not None:
            return True
        if time.monotonic() < self._down_until:
            return False
        try:
            self.client = self._connect()
        except self._errors as error:
            self._failed(error)
            return False
        return True

    def set_keys(self, hmac_keys: KeyOrKeys = None, encryption_keys: KeyOrKeys = None) -> None:
        """Replace the keys (a rotation: new first, old after, until old entries have expired).
        A ValueError leaves the keys in force unchanged. Safe while another thread reads."""
        self._keys = SealingKeys.parse(hmac_keys, encryption_keys)

    @property
    def hmac_keys(self) -> tuple[bytes, ...]:
        return self._keys.hmac_keys

    @property
    def encryption_keys(self) -> tuple[bytes, ...]:
        return self._keys.encryption_keys

    @property
    def encrypted(self) -> bool:
        return bool(self._keys.ciphers)

    def entry_name(self, key: bytes) -> bytes:
        """The Redis key a block is stored under (for tools that read the raw entries)."""
        return self._name(key)

    def _name(self, key: bytes) -> bytes:
        return self.prefix.encode() + key.hex().encode()

    def _seal(self, name: bytes, payload: bytes) -> bytes:
        keys = self._keys
        if keys.ciphers:
            nonce = secrets.token_bytes(NONCE_BYTES)  # random: 2^32 values per key stay far from a collision
            return nonce + keys.ciphers[0].encrypt(nonce, payload, name)
        return _tag(keys.hmac_keys[0], name, payload) + payload

    def _open(self, name: bytes, value: bytes) -> bytes:
        """The payload sealed in `value` under `name` with any key in force; else CorruptBlock."""
        keys = self._keys
        if keys.ciphers:
            for cipher in keys.ciphers:
                try:
                    return cipher.decrypt(value[:NONCE_BYTES], value[NONCE_BYTES:], name)
                except (_invalid_tag(), ValueError):  # ValueError: a value too short to hold a nonce
                    continue
            raise CorruptBlock("AES-GCM authentication failed")
        tag, payload = value[:TAG_BYTES], memoryview(value)[TAG_BYTES:]  # a view: no copy of the block
        if any(hmac.compare_digest(tag, _tag(key, name, payload)) for key in keys.hmac_keys):
            return payload
        raise CorruptBlock("HMAC tag mismatch")

    def _failed(self, error: Exception) -> None:
        self.stats.errors += 1
        self.last_error = f"{type(error).__name__}: {error}"
        self._down_until = time.monotonic() + self.retry_seconds
        if self._up:
            self._up = False
            log.warning(
                "Redis tier unreachable (%s): serving without it (misses recompute), retrying every %.0f s",
                self.last_error,
                self.retry_seconds,
            )

    def _answered(self) -> None:
        if not self._up:
            self._up = True
            log.warning("Redis tier reachable again")

    def _resting(self) -> bool:
        """True (and counted as an error) while a recent failure says Redis is down."""
        if time.monotonic() < self._down_until or not self._connected():
            self.stats.errors += 1
            return True
        return False

    @property
    def available(self) -> bool:
        """Whether calls go to Redis now (False inside the fail-fast window after a failure)."""
        return time.monotonic() >= self._down_until and self.client is not None

    def put(self, key: bytes, block: torch.Tensor) -> bool:
        if self._resting():
            self.stats.refused_puts += 1
            return False
        name = self._name(key)
        value = self._seal(name, encode_block(key, block))
        try:
            self.client.set(name, value, ex=self.ttl_seconds)
        except self._errors as error:
            self._failed(error)
            self.stats.refused_puts += 1
            return False
        self.stats.puts += 1
        self._answered()
        return True

    def put_many(self, items: Sequence[tuple[bytes, torch.Tensor]]) -> int:
        """Store several blocks in one round trip (a pipeline; on a cluster, one per node); returns
        how many Redis took. A failure refuses the rest, as `put` does."""
        if not items:
            return 0
        if self._resting():
            self.stats.refused_puts += len(items)
            return 0
        pipeline = self.client.pipeline(transaction=False)
        for key, block in items:
            name = self._name(key)
            pipeline.set(name, self._seal(name, encode_block(key, block)), ex=self.ttl_seconds)
        try:
            results = pipeline.execute(raise_on_error=False)
        except self._errors as error:
            self._failed(error)
            self.stats.refused_puts += len(items)
            return 0
        taken = sum(1 for result in results if result is True)
        if taken < len(items):
            failures = [result for result in results if isinstance(result, Exception)]
            if failures:
                self._failed(failures[0])
        self.stats.puts += taken
        self.stats.refused_puts += len(items) - taken
        if taken:
            self._answered()
        return taken

    def get(self, key: bytes) -> torch.Tensor | None:
        self.stats.gets += 1
        if self._resting():
            return None
        name = self._name(key)
        try:
            value = self.client.get(name)
        except self._errors as error:
            # a list or hash planted under the name is bad data, not a Redis outage
            if not (isinstance(error, self._response_error) and str(error).startswith("WRONGTYPE")):
                self._failed(error)
                return None
            value = b""
        self._answered()
        return self._decoded(key, name, value)

    def get_many(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        """`get` for each key in one round trip (a pipeline)."""
        if len(keys) < 2 or self._resting():
            return [self.get(key) for key in keys]
        self.stats.gets += len(keys)
        names = [self._name(key) for key in keys]
        pipeline = self.client.pipeline(transaction=False)
        for name in names:
            pipeline.get(name)
        try:
            values = pipeline.execute(raise_on_error=False)
        except self._errors as error:
            self._failed(error)
            return [None] * len(keys)
        self._answered()
        return [self._decoded(key, name, value) for key, name, value in zip(keys, names, values)]

    def _decoded(self, key: bytes, name: bytes, value) -> torch.Tensor | None:
        """A pipelined GET's answer as a block; None when absent, corrupt (deleted) or an error."""
        if value is None:
            return None
        if isinstance(value, Exception) and not str(value).startswith("WRONGTYPE"):
            self._failed(value)
            return None
        try:
            if not isinstance(value, bytes):
                raise CorruptBlock(f"Redis returned {type(value).__name__}, not bytes")
            # the tag or the GCM tag has authenticated the payload: its own checksum would be a second pass
            block = decode_block(key, self._open(name, value), authenticated=True)
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


def _invalid_tag() -> type[Exception]:
    """cryptography's InvalidTag: imported only with an encryption key in force (the crypto extra)."""
    from cryptography.exceptions import InvalidTag

    return InvalidTag
