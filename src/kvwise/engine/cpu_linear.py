"""The model's float32 projections on CPU, by size: a few rows through the compiled `small_linear`
kernel, more through oneDNN; bfloat16 projections of a few rows through `small_linear_bf16` where
the CPU has AVX512-BF16 (more rows stay with torch, which calls oneDNN).

A decode step multiplies each weight of the model by one row per running sequence. At that size
MKL's sgemm spends its time packing the weight; kernels/small_linear.cpp streams each weight row
once; with the weights coming from memory it measured up to 2x faster at 1 row, and its AVX-512
path for 16-64 rows 1.3-2.4x (its AVX2 path matches sgemm by 64 rows). Above MAX_ROWS rows (the
prefill's projections) `torch.nn.functional.linear` calls MKL's sgemm in float32; oneDNN's
matmul (`torch.ops.mkldnn._linear_pointwise`, the op inductor uses on CPU), given the same dense
weight and no copy of it, ran the embedded model's projections 1.35x faster at 300-2048 rows in
a microbenchmark on this project's AVX-512 machine, and a whole 2,048-token forward 1.07x
(bfloat16 already goes through oneDNN).

While the runner's forward runs, each plain `nn.Linear` of the model takes these paths;
afterwards the model is exactly as it was, so other users of the same model object see torch's
linear.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from kvwise.engine.attribute_swaps import ABSENT, swaps

MAX_ROWS = 64  # above this, a GEMM's packing of the weight pays for itself: oneDNN (or MKL) takes over
# bfloat16: up to this many rows `small_linear_bf16` (AVX512-BF16) beats oneDNN, whose set-up costs
# about 50 us a call (a microbenchmark of the embedded model's projections: 2-5x faster at 1-3 rows,
# even at 8, slower from 16 on, where the products, not the weight's bytes, bound it)
MAX_BF16_ROWS = 4


def onednn_linear():
    """oneDNN's linear, y = x @ weight^T + bias for 2-D float32 x, or None where this torch lacks
    it or it fails on this CPU."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return None

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # a registered aten op, not a private attribute: torch names its oneDNN ops with a leading _
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # noqa: SLF001

    try:  # with and without a bias, as projections come
        probe, weight = torch.arange(12.0).view(3, 4), torch.arange(8.0).view(2, 4)
        for bias in (torch.ones(2), None):
            if not torch.allclose(linear(probe, weight, bias), F.linear(probe, weight, bias)):
                return None
    except RuntimeError:
        return None
    return linear


class CpuLinears:
    def __init__(self, model: torch.nn.Module, small, large=None, small_bf16=None):
        """small: `small_linear` for float32 inputs of at most MAX_ROWS rows, or None; large:
        `onednn_linear()` for more rows, or None (torch's linear); small_bf16: `small_linear_bf16`
        for bfloat16 inputs of at most MAX_BF16_ROWS rows, or None."""
        self.small, self.large, self.small_bf16 = small, large, small_bf16
        dtypes = {torch.float32} | ({torch.bfloat16} if small_bf16 is not None else set())
        # subclasses (quantized or LoRA linears) and modules whose forward is already wrapped on the
        # instance (accelerate's offloading hooks) keep their own path
        self.layers = [
            module
            for module in model.modules()
            if type(module) is torch.nn.Linear
            and "forward" not in vars(module)
            and module.weight.dtype in dtypes
            and module.weight.device.type == "cpu"
        ]
        self.forwards = [functools.partial(self._forward, layer) for layer in self.layers]

    def _forward(self, layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        features = x.shape[-1]
        rows = x.numel() // features if features else 0
        if rows == 0 or x.dtype != layer.weight.dtype or x.device.type != "cpu":
            return F.linear(x, layer.weight, layer.bias)
        if x.dtype == torch.bfloat16:
            compute = self.small_bf16 if rows <= MAX_BF16_ROWS else None
        elif x.dtype == torch.float32:
            compute = self.small if rows <= MAX_ROWS else self.large
        else:
            compute = None
        if compute is None:
            return F.linear(x, layer.weight, layer.bias)
        out = compute(x.reshape(rows, features), layer.weight, layer.bias)  # [rows, out_features]
        return out.view(*x.shape[:-1], layer.out_features)

    @contextlib.contextmanager
    def active(self):
        swapped = []
        try:
            for layer, forward in zip(self.layers, self.forwards):
                if swaps.enter(layer, "forward", forward, ABSENT):
                    swapped.append(layer)
            yield
        finally:
            for layer in swapped:
                swaps.leave(layer, "forward")
