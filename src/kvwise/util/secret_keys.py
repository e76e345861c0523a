"""Secret keys in files: the namespace key that keys every block's identity, and others like it.

A key file holds one or more keys, hex, one per line; the first line is the key in use, later
lines are keys being rotated out, still accepted (see `server.key_files`). When no file is
given, one is generated on first use under `$KVWISE_HOME/secrets/` with mode 0600, so two
servers share block keys only when they share the file.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from kvwise.util.home import kvwise_home

KEY_BYTES = 32


def default_key_path(name: str) -> Path:
    return kvwise_home() / "secrets" / f"{name}.key"


def load_keys(path: str | Path) -> list[bytes]:
    """Every key in the file (hex, one per line, `#` comments), the signing key first."""
    try:
        lines = Path(path).read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read key file {str(path)!r}: {getattr(error, 'strerror', None) or error}") from None
    keys = []
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            key = bytes.fromhex(text)
        except ValueError:
            raise ValueError(f"{path}:{number}: a key is hex digits") from None
        if len(key) < 16:
            raise ValueError(f"{path}:{number}: a key needs at least 16 bytes (32 hex digits), got {len(key)}")
        keys.append(key)
    if not keys:
        raise ValueError(f"key file {str(path)!r} holds no key")
    return keys


def load_or_create_key(path: str | Path | None, name: str) -> bytes:
    """The signing key of `path`, or of the default file for `name`, made on first use."""
    return load_or_create_keys(path, name)[0]


def load_or_create_keys(path: str | Path | None, name: str) -> list[bytes]:
    """Every key of `path`, or of the default file for `name` (made on first use), first in use."""
    if path is not None:
        return load_keys(path)
    target = default_key_path(name)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        staging = target.with_suffix(f".{os.getpid()}.tmp")
        descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(secrets.token_hex(KEY_BYTES) + "\n")
        try:
            os.link(staging, target)  # atomic, and never replaces a key another process just made
        except FileExistsError:
            pass
        finally:
            staging.unlink()
    return load_keys(target)


def namespace_key(given: bytes | None = None) -> bytes:
    """The key that keys every block's identity: `given`, else the default file's (made on first use)."""
    return given if given is not None else load_or_create_key(None, "namespace")
