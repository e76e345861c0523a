"""Every secret `kvwise serve` reads from files, read as one set, and reloaded on SIGHUP.

    keys = read_server_keys(args)        # at start; ValueError names the file that is wrong
    apply_server_keys(app, keys)         # on SIGHUP, after a successful read
    install_key_reload(app, args)        # SIGHUP -> read -> apply, or keep the old keys

Each key file may list several keys, one per line: the first is in use (it keys new blocks, signs
and encrypts new entries), the others are still accepted (a rotation: put the new key first, keep
the old one until the entries written under it have aged out, then drop it). A reload is all or
nothing: if any file does not parse, nothing changes and the error is logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass

from kvwise.util.secret_keys import load_keys, load_or_create_keys

API_KEY_ENVIRONMENT = "KVWISE_API_KEY"  # the one key of --api-key, read at startup

log = logging.getLogger("kvwise.server")


@dataclass(frozen=True)
class ServerKeys:
    api_keys: dict | None  # KEY -> KeyEntry; None: no authentication
    namespace: list[bytes]  # key every block's identity
    disk_encryption: list[bytes] | None  # None: from KVWISE_DISK_KEY, or plaintext
    redis_hmac: list[bytes] | None  # None: from KVWISE_REDIS_HMAC_KEY
    redis_encryption: list[bytes] | None  # None: from KVWISE_REDIS_KEY, or plaintext

    @property
    def disk_mac(self) -> list[bytes]:
        """Disk checksums are keyed with keys derived from the namespace keys: one secret to keep."""
        return [disk_mac_key(key) for key in self.namespace]


def disk_mac_key(namespace_key: bytes) -> bytes:
    return hmac.new(namespace_key, b"kvwise disk tier", hashlib.sha256).digest()


def _optional_keys(path: str | None) -> list[bytes] | None:
    return load_keys(path) if path else None


def read_server_keys(args) -> ServerKeys:
    """Every key file `args` names (and the namespace key, generated on first start)."""
    from kvwise.server.api_keys import KeyEntry, load_api_keys

    single = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENVIRONMENT) or None
    if single and args.api_keys:
        raise ValueError(
            f"--api-key (or {API_KEY_ENVIRONMENT}) is one key for everything: leave out --api-keys, or use only it"
        )
    api_keys = load_api_keys(args.api_keys) if args.api_keys else None
    if single:  # vLLM's --api-key: tenant `default`, every permission
        api_keys = {single: KeyEntry("default", admin=True, shared_read=True, shared_write=True)}
    return ServerKeys(
        api_keys=api_keys,
        namespace=load_or_create_keys(args.namespace_key_file, "namespace"),
        disk_encryption=_optional_keys(args.disk_key_file),
        redis_hmac=_optional_keys(getattr(args, "redis_hmac_key_file", None)),
        redis_encryption=_optional_keys(getattr(args, "redis_key_file", None)),
    )


def apply_server_keys(app, keys: ServerKeys) -> None:
    """Put a new key set in use: API keys at once, the engine's and tiers' keys on the engine
    thread between two steps (no step sees half a rotation)."""
    from kvwise.tiers.disk import DiskTier
    from kvwise.tiers.redis_tier import RedisTier

    engine, settings = app.state.engine, app.state.settings
    if keys.api_keys is not None:
        settings.api_keys = keys.api_keys  # one assignment: a request sees the old keys or the new

    def rekey_engine() -> None:
        core = engine.core
        core.set_namespace_keys(keys.namespace)
        for tier in core.kv.prefix_tiers():
            if isinstance(tier, DiskTier):
                tier.set_keys(keys.disk_mac, keys.disk_encryption)
            elif isinstance(tier, RedisTier) and (keys.redis_hmac or keys.redis_encryption):
                tier.set_keys(keys.redis_hmac or tier.hmac_keys, keys.redis_encryption or tier.encryption_keys)

    engine.call_soon(rekey_engine)


def install_key_reload(app, args) -> None:
    """SIGHUP re-reads every key file: API keys are added, revoked or re-permissioned, and the
    namespace, disk and Redis keys rotate, without a restart."""
    import signal

    def reload(signum, frame):
        try:
            keys = read_server_keys(args)
        except ValueError as error:
            log.error("SIGHUP: kept the previous keys: %s", error)
            return
        apply_server_keys(app, keys)
        log.warning(
            "SIGHUP: reloaded keys (%s API keys, %d namespace keys)",
            len(keys.api_keys) if keys.api_keys is not None else "no",
            len(keys.namespace),
        )

    if hasattr(signal, "SIGHUP") and os.name == "posix":
        signal.signal(signal.SIGHUP, reload)
