"""A compressed document as bytes, for the host, disk and Redis tiers, and back.

When a compressed document (`CompressedEntry`) has to leave the device, its region goes to the
prefix tiers under the same key, as one safetensors blob inside the tiers' authenticated payload
(`tiers/payload.py`, whose format version counts it). What it holds:

    tokens [n], reused [1]                        what a hit is checked against
    counts [layers, kv_heads], positions [layers, kv_heads, width]
    keys, values [rows, head_dim]                 device pages: each head's kept rows, layer by layer
    quant.<role>.<name> [pages, ...]              quantized pages: their codes and scales as stored
    sinks.keys, sinks.values [rows, head_dim]     quantized: each head's sinks, in the model's dtype
    stats.<name> [layers, kv_heads, width]        the policy's running statistics, if any

Quantized codes travel as they are, so a document comes back bit for bit. Whatever the bytes,
`read_entry` returns the state or raises ValueError.
"""

from __future__ import annotations

import safetensors.torch
import torch

from kvwise.engine.head_region import HeadRegion

# /2: quantized regions hold sinks and pages of one group (the mix's StoredForm); a /1 entry is a miss
FORMAT = "kvwise-head-region/2"


def write_entry(region: HeadRegion, tokens, reused: int, stats, storage) -> torch.Tensor:
    """The blob (uint8 [n]) of a region with its tokens and statistics."""
    counts = torch.tensor(region.counts, dtype=torch.int64)
    width = max((positions.shape[1] for positions in region.positions), default=0)
    state = {
        "tokens": torch.tensor(list(tokens), dtype=torch.int64),
        "reused": torch.tensor([reused], dtype=torch.int64),
        "counts": counts,
        "positions": torch.stack([_pad(positions.cpu(), width, -1) for positions in region.positions]),
    }
    if region.quant is None:
        keys, values = storage.cells()
        rows = torch.cat([cells[valid] for cells, valid in zip(region.cells, region.valid)])
        state["keys"], state["values"] = keys[rows].cpu(), values[rows].cpu()
    else:
        ids = [page for layer in region.pages for head in layer for page in head]
        state.update({f"quant.{name}": table for name, table in region.quant.export(ids).items()})
        full = [region.full_rows(storage, layer) for layer in range(len(region.counts))]
        state["sinks.keys"] = torch.cat([keys for keys, _ in full]).cpu()
        state["sinks.values"] = torch.cat([values for _, values in full]).cpu()
    for name in stats[0] if stats else ():
        state[f"stats.{name}"] = torch.stack([_pad(layer[name].cpu(), width, 0.0) for layer in stats])
    blob = safetensors.torch.save({name: tensor.contiguous() for name, tensor in state.items()}, {"format": FORMAT})
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def read_entry(blob: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state `write_entry` wrote; ValueError for anything else."""
    data = blob.numpy().tobytes()
    try:
        state = safetensors.torch.load(data)
        metadata = _metadata(data)
    except Exception as error:  # noqa: BLE001 - any unreadable blob is a miss
        raise ValueError(f"not a compressed document: {error}") from None
    if metadata.get("format") != FORMAT:
        raise ValueError(f"not a compressed document of format {FORMAT}: {metadata.get('format')!r}")
    for name in ("tokens", "reused", "counts", "positions"):
        if name not in state:
            raise ValueError(f"a compressed document without {name}")
    return state


def _metadata(data: bytes) -> dict:
    import json
    import struct

    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]).get("__metadata__", {})


def _pad(tensor: torch.Tensor, width: int, value) -> torch.Tensor:
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]), value=value)
