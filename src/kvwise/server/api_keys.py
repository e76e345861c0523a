"""The `--api-keys` file: one `KEY TENANT [PERMISSION ...]` entry per line; `#` starts a comment.

Each key maps to a tenant whose cached prefixes are isolated from every other tenant's.
Permissions, after the tenant:
- `admin`: may scrape `/metrics`;
- `shared-read`: may look up prefixes in the shared namespace (a system prompt many tenants send);
- `shared-write`: may publish a marked leading segment (`kv_prefix`) to the shared namespace;
- `shared`: both shared permissions, and the key's requests use the shared namespace by default
  (as the `X-KVWise-Shared-Prefix: true` header asks per request).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

from kvwise.core.hashing import SHARED_TENANT

PERMISSIONS = ("admin", "shared-read", "shared-write", "shared")


@dataclass(frozen=True)
class KeyEntry:
    tenant: str
    shared_prefix: bool = False  # `shared`: the shared namespace by default
    admin: bool = False
    shared_read: bool = False
    shared_write: bool = False


def load_api_keys(path: str | Path) -> dict[str, KeyEntry]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or error
        raise ValueError(f"cannot read the API key file {str(path)!r}: {reason}") from None
    keys: dict[str, KeyEntry] = {}
    for number, line in enumerate(lines, start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        unknown = [word for word in words[2:] if word not in PERMISSIONS]
        if len(words) < 2 or unknown:
            raise ValueError(
                f"{path}:{number}: expected `KEY TENANT [{' | '.join(PERMISSIONS)} ...]`, got {line.strip()!r}"
            )
        if words[1] == SHARED_TENANT:
            raise ValueError(f"{path}:{number}: {SHARED_TENANT!r} is the shared namespace, not a tenant name")
        if words[0] in keys:
            raise ValueError(f"{path}:{number}: the key is listed twice")
        granted = set(words[2:])
        shared = "shared" in granted
        keys[words[0]] = KeyEntry(
            words[1],
            shared_prefix=shared,
            admin="admin" in granted,
            shared_read=shared or "shared-read" in granted,
            shared_write=shared or "shared-write" in granted,
        )
    if not keys:
        raise ValueError(f"the API key file {str(path)!r} holds no keys")
    return keys


def find_key(keys: dict[str, KeyEntry], presented: str) -> KeyEntry | None:
    """The entry for `presented`, compared in constant time so timing does not leak key bytes."""
    match = None
    for key, entry in keys.items():
        if hmac.compare_digest(key.encode(), presented.encode()):
            match = entry
    return match
