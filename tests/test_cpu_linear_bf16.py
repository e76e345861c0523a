"""The bfloat16 projections of a few rows (kernels/small_linear_bf16.cpp, AVX512-BF16) against
torch's linear, and how `CpuLinears` routes bfloat16 layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvwise.engine import cpu_kernel
from kvwise.engine.cpu_linear import MAX_BF16_ROWS, CpuLinears

kernel = cpu_kernel.small_linear_bf16_kernel()
needs_bf16 = pytest.mark.skipif(kernel is None, reason="no AVX512-BF16 here (or no compiler): torch's linear runs")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17])
@pytest.mark.parametrize(("features", "outputs"), [(576, 1538), (33, 7), (40, 130), (64, 96)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_torch_linear_to_a_bfloat16_rounding(rows, features, outputs, with_bias):
    torch.manual_seed(rows * features + outputs)
    x, weight = torch.randn(rows, features).bfloat16(), torch.randn(outputs, features).bfloat16()
    bias = torch.randn(outputs).bfloat16() if with_bias else None
    got = kernel(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, outputs)
    exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    # float32 products and sums, rounded once: within half a bfloat16 step (2^-8) of the exact value
    torch.testing.assert_close(got.float(), exact, rtol=2**-8, atol=1e-3)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=2**-7, atol=1e-2)


@needs_bf16
def test_refuses_what_it_cannot_compute():
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        kernel(torch.ones(2, 4), torch.ones(3, 4), None)
    with pytest.raises(RuntimeError, match="bad shapes"):
        kernel(torch.ones(2, 4).bfloat16(), torch.ones(3, 5).bfloat16(), None)
    with pytest.raises(RuntimeError, match="one value per output"):
        kernel(torch.ones(2, 4).bfloat16(), torch.ones(3, 4).bfloat16(), torch.ones(2).bfloat16())


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, x, weight, bias):
        self.calls.append((x.dtype, x.shape[0]))
        return F.linear(x, weight, bias)


def test_bfloat16_layers_of_few_rows_take_the_bfloat16_kernel():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4, bias=False)).bfloat16()
    small, small_bf16 = Recorder(), Recorder()
    linears = CpuLinears(model, small, None, small_bf16)
    few, many = torch.randn(MAX_BF16_ROWS, 8).bfloat16(), torch.randn(MAX_BF16_ROWS + 1, 8).bfloat16()
    expected = model(few)
    with linears.active():
        torch.testing.assert_close(model(few), expected)
        model(many)  # torch's linear (oneDNN) from MAX_BF16_ROWS + 1 rows on
    assert small_bf16.calls == [(torch.bfloat16, MAX_BF16_ROWS)] * 2 and small.calls == []
    # without a bfloat16 kernel, bfloat16 layers are not wrapped at all
    assert CpuLinears(model, small).layers == []
