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
from dataclasses import dataclass, field
from functools import cached_property

KEY_BYTES = 32
ROOT_KEY = bytes(KEY_BYTES)
SHARED_TENANT = "__shared__"  # the opt-in namespace for public prefixes (system prompts)


@dataclass(frozen=True)
class Namespace:
    """What makes two identical token blocks different blocks.

    model_id: a fingerprint of the model's weights (or its name, where no model is at hand).
    tenant: the tenant; SHARED_TENANT for the opt-in shared namespace.
    kv_format: KV dtype plus quantization and compression settings, e.g. "bfloat16/kivi4/full@0".
    secret: the server's namespace key. The digest is keyed with it, so nobody without it can
        compute a tenant's block keys from its name and a guessed prompt, on any tier.
    """

    model_id: str
    tenant: str
    kv_format: str = ""
    secret: bytes = field(default=b"", repr=False)

    def digest(self) -> bytes:
        return self._digest

    @cached_property
    def _digest(self) -> bytes:  # once per namespace: lookups ask for it at every block
        fields = "\x00".join((self.model_id, self.tenant, self.kv_format)).encode()
        return hashlib.blake2b(fields, digest_size=KEY_BYTES, key=self.secret[:64], person=b"kvwise-ns").digest()

    def digest_at(self, block_index: int) -> bytes:
        """The namespace digest of block `block_index` of a sequence (one for every block here)."""
        return self._digest

    def with_secret(self, secret: bytes) -> Namespace:
        """The same namespace under another server secret (a retired key during a rotation)."""
        return Namespace(self.model_id, self.tenant, self.kv_format, secret)

    def shared(self) -> Namespace:
        return Namespace(self.model_id, SHARED_TENANT, self.kv_format, self.secret)

    def with_shared_prefix(self, shared_blocks: int) -> Namespace | SegmentedNamespace:
        """The first `shared_blocks` blocks in the shared namespace, the rest in this one."""
        return self if shared_blocks <= 0 else SegmentedNamespace(self, shared_blocks)


@dataclass(frozen=True)
class SegmentedNamespace:
    """A sequence whose leading segment (a system prompt marked shared) lives in the shared
    namespace and whose rest (the private part, the output) in the tenant's own. Blocks after the
    segment chain on its last key, so the private rest stays the tenant's alone; every block is
    charged to the tenant who wrote it (`tenant`)."""

    own: Namespace
    shared_blocks: int

    @property
    def tenant(self) -> str:
        return self.own.tenant

    def digest_at(self, block_index: int) -> bytes:
        return self._shared_digest if block_index < self.shared_blocks else self.own.digest()

    def with_secret(self, secret: bytes) -> SegmentedNamespace:
        return SegmentedNamespace(self.own.with_secret(secret), self.shared_blocks)

    @cached_property
    def _shared_digest(self) -> bytes:
        return self.own.shared().digest()


def block_key(parent_key: bytes, token_ids: Sequence[int], namespace_digest: bytes) -> bytes:
    """The key of a block: BLAKE2b(parent key, namespace, token ids as little-endian int64)."""
    digest = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvwise-blk")
    digest.update(parent_key)
    digest.update(namespace_digest)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def chain_keys(token_ids: Sequence[int], block_size: int, namespace: Namespace | SegmentedNamespace) -> list[bytes]:
    """Keys of every full block of `token_ids`, each chained on the one before."""
    parent, keys = ROOT_KEY, []
    for index, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        parent = block_key(parent, token_ids[start : start + block_size], namespace.digest_at(index))
        keys.append(parent)
    return keys


def compressed_key(namespace: Namespace, compression: str, token_ids: Sequence[int]) -> bytes:
    """The key of a context compressed query-agnostically: its tokens (everything before the end
    of the compressed document, so another system prompt before the same document is another
    entry) in `namespace` extended with `compression`, every setting that changes what is stored
    (policy and its options, ratio, quantizer). The library's `CompressedContexts` and the
    engine's compressed prefixes both name entries this way."""
    extended = Namespace(namespace.model_id, namespace.tenant, f"{namespace.kv_format}|{compression}", namespace.secret)
    return block_key(ROOT_KEY, list(token_ids), extended.digest())
