"""Local disk tier: one file per block, written atomically, optionally encrypted with AES-GCM.

File: `DIR/ab/abcdef....kvb`, the block payload of `tiers.payload` (magic, version, key, shape,
dtype, checksum, data). With an encryption key (32 bytes, from the constructor or the
KVWISE_DISK_KEY environment variable as hex), the file is nonce || AES-GCM(payload) with the
block key as associated data, so a file copied under another name fails authentication.

Writes go to a temporary file in the same folder and are renamed into place, so a reader never
sees half a block; the temporaries a killed process leaves behind are removed when a tier opens
the folder. A full disk (or any OSError) makes `put` return False and count a refused write;
nothing else breaks. A file that fails its checksum or authentication is deleted and
counted as corrupt, and the caller recomputes the block.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from pathlib import Path

import numpy
import torch

from kvwise.tiers.base import Tier
from kvwise.tiers.payload import CorruptBlock, decode_block, encode_block
from kvwise.util.extras import require

KEY_ENVIRONMENT = "KVWISE_DISK_KEY"
NONCE_BYTES = 12


def _ciphers(encryption_keys) -> tuple:
    """AESGCM objects for a key, or a list of keys during a rotation (the first encrypts, every one
    decrypts); () without a key. A key is 32 bytes, or hex (as KVWISE_DISK_KEY holds it)."""
    if encryption_keys is None:
        encryption_keys = os.environ.get(KEY_ENVIRONMENT) or None
    if encryption_keys is None:
        return ()
    if isinstance(encryption_keys, str | bytes | bytearray):
        encryption_keys = [encryption_keys]
    AESGCM = require("cryptography.hazmat.primitives.ciphers.aead", "crypto", "an encrypted disk tier").AESGCM

    ciphers = []
    for key in encryption_keys:
        if isinstance(key, str):
            try:
                key = bytes.fromhex(key)
            except ValueError:
                raise ValueError(f"the disk encryption key must be hex (from {KEY_ENVIRONMENT} or config)") from None
        if len(key) != 32:
            raise ValueError(f"the disk encryption key must be 32 bytes (AES-256), got {len(key)}")
        ciphers.append(AESGCM(bytes(key)))
    return tuple(ciphers)


class DiskTier(Tier):
    name = "disk"

    def __init__(
        self,
        directory: str | Path,
        capacity_bytes: int | None = None,
        encryption_key=None,
        mac_key: bytes | None = None,
    ):
        """mac_key: keys each file's checksum (keyed BLAKE3), so files written by anyone without it
        fail; encryption (AES-GCM) authenticates them too. Either may be a list during a key
        rotation: the first writes, every one reads (`set_keys` swaps them at run time)."""
        super().__init__()
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._root = str(self.directory)
        self.capacity_bytes = capacity_bytes
        self.set_keys(mac_key, encryption_key)
        self.last_error: str | None = None
        self._remove_stale_temporaries()
        # the size each entry was written with: a file cut short behind the tier's back must not
        # leave its lost bytes counted (and the capacity check refusing writes) until a restart
        self._sizes = {path.name: path.stat().st_size for path in self.directory.glob("*/*.kvb")}
        self.stats.bytes_held = sum(self._sizes.values())

    def _remove_stale_temporaries(self) -> None:
        """A process killed between writing a temporary and renaming it leaves the temporary
        behind, uncounted and never read again. Another process writing to the same folder at
        this moment only sees that one put refused (its rename finds no file)."""
        for path in self.directory.glob("*/*.tmp"):
            with contextlib.suppress(OSError):
                path.unlink()

    def path(self, key: bytes) -> Path:
        return Path(self._file_name(key))

    def _file_name(self, key: bytes) -> str:
        """The entry's path as a string: a restore reads hundreds of files, and pathlib's joins
        cost as much per file as the checksum."""
        name = key.hex()
        return f"{self._root}/{name[:2]}/{name}.kvb"

    def put(self, key: bytes, block: torch.Tensor) -> bool:
        mac_keys, ciphers = self._keys
        payload = encode_block(key, block, mac_keys)
        if ciphers:
            nonce = secrets.token_bytes(NONCE_BYTES)
            payload = nonce + ciphers[0].encrypt(nonce, payload, key)
        target = self.path(key)
        previous = self._size_of(target)
        if self.capacity_bytes is not None and self.stats.bytes_held - previous + len(payload) > self.capacity_bytes:
            self.stats.refused_puts += 1
            self.last_error = "capacity reached"
            return False
        temporary = None
        try:
            target.parent.mkdir(exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".tmp", delete=False) as handle:
                temporary = Path(handle.name)
                handle.write(payload)
            os.replace(temporary, target)
        except OSError as error:  # ENOSPC, EDQUOT, EIO...: refuse, report, carry on
            if temporary is not None:
                temporary.unlink(missing_ok=True)
            self.stats.refused_puts += 1
            self.last_error = f"{type(error).__name__}: {error.strerror or error}"
            return False
        self.stats.bytes_held += len(payload) - previous
        self._sizes[target.name] = len(payload)
        self.stats.puts += 1
        return True

    def get(self, key: bytes) -> torch.Tensor | None:
        self.stats.gets += 1
        try:
            payload = _read_into_buffer(self._file_name(key))  # the block's tensor keeps this memory: no copy
        except FileNotFoundError:
            return None
        except OSError as error:
            self.stats.errors += 1
            self.last_error = str(error)
            return None
        mac_keys, ciphers = self._keys
        try:
            if ciphers:
                payload = self._open(ciphers, key, payload)
            block = decode_block(key, payload, mac_keys)
        except CorruptBlock:
            self.stats.corrupt += 1
            self.delete(key)
            return None
        self.stats.hits += 1
        return block

    def set_keys(self, mac_keys=None, encryption_keys=None) -> None:
        """Swap the keys (a rotation: new first, old after, until old entries have aged out). One
        assignment of a tuple, so a concurrent read sees the old keys or the new, never a mix."""
        if isinstance(mac_keys, bytes | bytearray):
            mac_keys = [mac_keys]
        self._keys = (tuple(bytes(key) for key in mac_keys or ()), _ciphers(encryption_keys))

    @property
    def mac_key(self) -> bytes | None:
        """The key that signs new entries' checksums (None: unkeyed)."""
        return self._keys[0][0] if self._keys[0] else None

    @property
    def encrypted(self) -> bool:
        return bool(self._keys[1])

    @staticmethod
    def _open(ciphers, key: bytes, payload: bytes) -> bytes:
        from cryptography.exceptions import InvalidTag

        for cipher in ciphers:
            try:
                return cipher.decrypt(payload[:NONCE_BYTES], payload[NONCE_BYTES:], key)
            except (InvalidTag, ValueError):
                continue
        raise CorruptBlock("authentication failed")

    def exists(self, key: bytes) -> bool:
        return self.path(key).exists()

    def delete(self, key: bytes) -> None:
        path = self.path(key)
        try:
            size = self._size_of(path)
            path.unlink()
        except FileNotFoundError:  # removed behind the tier's back: it no longer holds those bytes
            self.stats.bytes_held -= self._sizes.pop(path.name, 0)
            return
        self._sizes.pop(path.name, None)
        self.stats.bytes_held -= size
        self.stats.deletes += 1

    def _size_of(self, path: Path) -> int:
        """The bytes `path` was counted with (what this tier wrote, or found at start); for a file
        another process wrote meanwhile, its size now; 0 when there is none."""
        if path.name in self._sizes:
            return self._sizes[path.name]
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return 0


def _read_into_buffer(path: str) -> memoryview:
    """The file's bytes in a fresh, writable buffer (not zero-filled first: it is read over), with
    one system call per step: no file object is made."""
    descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(descriptor).st_size
        payload = memoryview(numpy.empty(size, dtype=numpy.uint8))
        read = os.readv(descriptor, [payload])
    finally:
        os.close(descriptor)
    return payload if read == size else payload[:read]  # a file cut short meanwhile: its checksum fails
