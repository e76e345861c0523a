"""Block identity: a chained content hash over the parent block, the tokens and a namespace.

One key names a block on every tier (GPU, host, disk, Redis). The namespace makes the same
tokens under another model, tenant or KV format a different block, so a tenant's prefixes can
never be matched, or fetched from a shared tier, by another tenant. Keys are BLAKE2b digests;
a hit is still confirmed by comparing tokens, never by the hash alone.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

KEY_BYTES = 32
ROOT_KEY = bytes(KEY_BYTES)
SHARED_TENANT = "__shared__"  # the opt-in namespace for public prefixes (system prompts)


@dataclass(frozen=True)
class Namespace:
    """What makes two identical token blocks different blocks.

    model_id: the model's name or path.
    tenant: the tenant's salt; SHARED_TENANT for the opt-in shared namespace.
    kv_format: KV dtype plus quantization and compression settings, e.g. "bfloat16/kivi4/full@0".
    """

    model_id: str
    tenant: str
    kv_format: str = ""

    def digest(self) -> bytes:
        fields = "\x00".join((self.model_id, self.tenant, self.kv_format)).encode()
        return hashlib.blake2b(fields, digest_size=KEY_BYTES, person=b"kvwise-ns").digest()

    def shared(self) -> Namespace:
        return Namespace(self.model_id, SHARED_TENANT, self.kv_format)


def block_key(parent_key: bytes, token_ids: Sequence[int], namespace_digest: bytes) -> bytes:
    """The key of a block: BLAKE2b(parent key, namespace, token ids as little-endian int64)."""
    digest = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvwise-blk")
    digest.update(parent_key)
    digest.update(namespace_digest)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def chain_keys(token_ids: Sequence[int], block_size: int, namespace: Namespace) -> list[bytes]:
    """Keys of every full block of `token_ids`, each chained on the one before."""
    namespace_digest, parent, keys = namespace.digest(), ROOT_KEY, []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start : start + block_size], namespace_digest)
        keys.append(parent)
    return keys
