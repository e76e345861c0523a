"""The `--api-keys` file: one `KEY TENANT [shared]` entry per line; `#` starts a comment.

Each key maps to a tenant whose cached prefixes are isolated from every other tenant's. The
optional third word `shared` makes that key's requests use the shared prefix namespace by
default (as the X-KVWise-Shared-Prefix header does per request).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

from kvwise.core.hashing import SHARED_TENANT


@dataclass(frozen=True)
class KeyEntry:
    tenant: str
    shared_prefix: bool = False


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
        if len(words) not in (2, 3) or (len(words) == 3 and words[2] != "shared"):
            raise ValueError(f"{path}:{number}: expected `KEY TENANT` or `KEY TENANT shared`, got {line.strip()!r}")
        if words[1] == SHARED_TENANT:
            raise ValueError(f"{path}:{number}: {SHARED_TENANT!r} is the shared namespace, not a tenant name")
        if words[0] in keys:
            raise ValueError(f"{path}:{number}: the key is listed twice")
        keys[words[0]] = KeyEntry(words[1], len(words) == 3)
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
