"""Tier entries into pool blocks through the CPU kernel (`write_blocks`): the same bytes as torch's
copy, every other case left to torch, and bad input refused."""

from __future__ import annotations

import os

import pytest
import torch

from kvwise.engine import cpu_kernel
from kvwise.engine.cpu_kernel import block_write_kernel
from kvwise.kv import paged
from kvwise.kv.paged import PagedKVStorage

kernel = block_write_kernel()
pytestmark = pytest.mark.skipif(
    kernel is None and not os.environ.get("CI"), reason="no C++ compiler: blocks are copied by torch here"
)


def _entries(count: int, dtype=torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 2, 8, 3, 16, generator=generator).to(dtype) for _ in range(count)]


def _storage(dtype=torch.bfloat16) -> PagedKVStorage:
    return PagedKVStorage(4, 20, 8, 3, 16, dtype)  # layers, blocks, block size, kv heads, head dim


def test_the_engine_registers_the_kernel_with_the_storage():
    assert paged._entry_writer is cpu_kernel.write_entries_in_kernel
    storage, entries = _storage(), _entries(2)
    storage.write_entries([5, 9], entries)  # through the registered writer
    assert torch.equal(storage.read_entry(5), entries[0]) and torch.equal(storage.read_entry(9), entries[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_writes_what_torch_writes(dtype, monkeypatch):
    entries, ids = _entries(6, dtype), [7, 2, 19, 0, 11, 12]
    kernel_made, torch_made = _storage(dtype), _storage(dtype)
    calls = []
    monkeypatch.setattr(paged, "_entry_writer", lambda *args: calls.append(1) or kernel(*args) or True)
    kernel_made.write_entries(ids, entries)
    monkeypatch.setattr(paged, "_entry_writer", None)
    torch_made.write_entries(ids, entries)
    assert calls == [1]
    assert torch.equal(kernel_made._kv, torch_made._kv)
    for block, entry in zip(ids, entries):
        assert torch.equal(kernel_made.read_entry(block), entry)
    untouched = [block for block in range(20) if block not in ids]
    assert not kernel_made._kv[:, :, untouched].any()


def test_entries_the_kernel_cannot_take_go_through_torch(monkeypatch):
    """A strided entry or one of another dtype is copied (and converted) by torch."""
    storage = _storage()
    calls = []
    monkeypatch.setattr(paged, "_entry_writer", lambda *args: calls.append(1) or kernel(*args) or True)
    strided = _entries(1, seed=1)[0].transpose(0, 1).contiguous().transpose(0, 1)
    wider = _entries(1, torch.float32, seed=2)[0]
    storage.write_entries([3, 4], [strided, wider])
    assert calls == []
    assert torch.equal(storage.read_entry(3), strided) and torch.equal(storage.read_entry(4), wider.bfloat16())


def test_the_kernel_refuses_what_does_not_fit():
    storage = _storage()
    pool, entry = storage._kv, _entries(1)[0]
    with pytest.raises(RuntimeError, match="block id 20 out of range"):
        kernel(pool, torch.tensor([20]), [entry])
    with pytest.raises(RuntimeError, match="one entry per block id"):
        kernel(pool, torch.tensor([1, 2]), [entry])
    with pytest.raises(RuntimeError, match="must be a contiguous CPU"):
        kernel(pool, torch.tensor([1]), [entry[:, :, :4].contiguous()])
    with pytest.raises(RuntimeError, match="must be a contiguous CPU"):  # the same bytes, another shape
        kernel(pool, torch.tensor([1]), [entry.transpose(2, 3).contiguous()])
    assert not pool.any()  # a refused call writes nothing
