"""Projections of a few rows on CPU through the compiled `small_linear` kernel.

A decode step multiplies each weight of the model by one row per running sequence. At that size
MKL's sgemm spends its time packing the weight; kernels/small_linear.cpp streams each weight row
once; with the weights coming from memory it measured up to 2x faster at 1 row, and its AVX-512
path for 16-64 rows 1.3-2.4x (its AVX2 path matches sgemm by 64 rows). While
the runner's forward runs, each plain `nn.Linear` of the model takes that path for inputs of at
most MAX_ROWS rows (decode steps, and the LM head after each chunk's last token); afterwards the
model is exactly as it was, so other users of the same model object see torch's linear.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

MAX_ROWS = 64  # above this, sgemm's packing pays for itself and MKL is as fast or faster


class SmallRowLinears:
    def __init__(self, model: torch.nn.Module, kernel):
        self.kernel = kernel
        # subclasses (quantized or LoRA linears) and modules whose forward is already wrapped on the
        # instance (accelerate's offloading hooks) keep their own path
        self.layers = [
            module
            for module in model.modules()
            if type(module) is torch.nn.Linear
            and "forward" not in vars(module)
            and module.weight.dtype == torch.float32
            and module.weight.device.type == "cpu"
        ]
        self.forwards = [functools.partial(self._forward, layer) for layer in self.layers]

    def _forward(self, layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        features = x.shape[-1]
        rows = x.numel() // features if features else 0
        if 0 < rows <= MAX_ROWS and x.dtype == torch.float32 and x.device.type == "cpu":
            out = self.kernel(x.reshape(rows, features), layer.weight, layer.bias)  # [rows, out_features]
            return out.view(*x.shape[:-1], layer.out_features)
        return F.linear(x, layer.weight, layer.bias)

    @contextlib.contextmanager
    def active(self):
        for layer, forward in zip(self.layers, self.forwards):
            layer.forward = forward
        try:
            yield
        finally:
            for layer in self.layers:
                del layer.forward
