"""`QuantPool`: quantized copies of requests' private blocks, for per-request `kv_quant`.

A request that asks for a quantizer keeps its shared prefix, its first block (the attention
sink) and its newest `residual_length` tokens in the model's dtype; every other full private
block moves here once its prefill is done: it is quantized whole (a KIVI key group is one block
of one head), its full-precision block goes back to the device pool (zeroed), and the request's
block table points at the quantized block instead (`Place.QUANTIZED`). On CPU the decode kernel
reads such blocks where they lie (`kernel_roles`); otherwise attention reads them back through
`read`. The bytes saved are real.
"""

from __future__ import annotations

import torch

from kvwise.core.block_pool import BlockPool
from kvwise.engine.quantized_kernel import kernel_roles
from kvwise.kv.blocks import QuantizedBlocks
from kvwise.kv.paged import PagedKVStorage
from kvwise.kv.quantizer import Quantizer


class QuantPool:
    def __init__(self, quantizer: Quantizer, storage: PagedKVStorage, num_blocks: int):
        """quantizer: ready for the model (`Quantizer.attach`: a low-rank codec's bases)."""
        self.name = quantizer.spec
        self.quantizer = quantizer
        layer = storage.keys[0]
        self.block_size, self.dtype, self.device = storage.block_size, layer.dtype, layer.device
        heads, head_dim = layer.shape[2], layer.shape[3]
        self.layers = [
            QuantizedBlocks(self.quantizer.for_layer(index), num_blocks, self.block_size, heads, head_dim, layer.device)
            for index in range(len(storage.keys))
        ]
        self.pool = BlockPool(num_blocks, self.block_size)
        self.pool.on_release(self._zero)
        self.block_bytes = sum(blocks.nbytes() for blocks in self.layers) // num_blocks
        self.error_sum = {"keys": 0.0, "values": 0.0}
        self.quantized_blocks = 0
        # per layer, what the CPU decode kernel reads these blocks through in place (None: it cannot)
        self.kernel_roles = kernel_roles(self.layers)

    @property
    def residual_blocks(self) -> int:
        return -(-self.quantizer.residual_length // self.block_size)

    def store(self, storage: PagedKVStorage, blocks: list[int]) -> list[int] | None:
        """Quantize device `blocks` (every layer); returns their QuantPool ids, or None when full.
        The relative reconstruction error of each block is measured once, here."""
        if not self.pool.can_allocate(len(blocks)):
            return None
        ids = self.pool.allocate(len(blocks))
        target = torch.tensor(ids, device=self.device)
        all_keys, all_values = storage.read_blocks(blocks)  # [num_layers, n, block_size, kv_heads, head_dim]
        for layer, quantized in enumerate(self.layers):
            keys, values = all_keys[layer], all_values[layer]
            quantized.write(target, keys, values)
            restored_keys, restored_values = quantized.read(target, self.dtype)
            self.error_sum["keys"] += _relative_error(keys, restored_keys) * len(blocks) / len(self.layers)
            self.error_sum["values"] += _relative_error(values, restored_values) * len(blocks) / len(self.layers)
        self.quantized_blocks += len(blocks)
        return ids

    def read(self, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [n, block_size, kv_heads, head_dim] in the model's dtype."""
        return self.layers[layer].read(ids, self.dtype)

    def release(self, ids: list[int]) -> None:
        self.pool.release(ids)

    def mean_error(self, part: str) -> float:
        return self.error_sum[part] / self.quantized_blocks if self.quantized_blocks else 0.0

    def used_bytes(self) -> int:
        return self.pool.stats().used * self.block_bytes

    def _zero(self, ids: list[int]) -> None:
        index = torch.tensor(ids, device=self.device)
        for quantized in self.layers:
            quantized.zero(index)


def _relative_error(original: torch.Tensor, restored: torch.Tensor) -> float:
    return float((original - restored).float().norm() / original.float().norm().clamp_min(1e-12))
