"""Block identity for the engine's requests: each request's namespace (tenant, model, KV format,
the server's secret), fixed when first asked for."""

from __future__ import annotations

from kvwise.core.hashing import Namespace, SegmentedNamespace


class TenantNamespaces:
    """namespace_of for a KVCacheManager: each request's own tenant's namespace, keyed with the server's
    secret, with its marked leading segment (whole blocks of it) in the shared namespace.

    A request's namespace is fixed the first time it is asked for, so a key rotation (`rekey`)
    changes the identity of new requests only: a running request inserts its blocks under the
    keys it matched them with."""

    def __init__(self, model_id: str, kv_format: str = "", secret: bytes = b"", block_size: int = 16):
        self.model_id, self.kv_format, self.block_size = model_id, kv_format, block_size
        self.secret = secret

    def rekey(self, secret: bytes) -> None:
        self.secret = secret  # one assignment: a request built concurrently gets the old or the new

    def __call__(self, request) -> Namespace | SegmentedNamespace:
        if request.namespace is None:
            own = Namespace(self.model_id, request.tenant, self.kv_format, self.secret)
            request.namespace = own.with_shared_prefix(request.shared_prefix_tokens // self.block_size)
        return request.namespace


def default_namespace(model_id: str, kv_format: str = "", secret: bytes = b"", block_size: int = 16):
    return TenantNamespaces(model_id, kv_format, secret, block_size)
