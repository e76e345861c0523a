"""The small_linear kernel against torch's linear, and CpuLinears leaving the model as it was."""

from __future__ import annotations

import os
import platform

import pytest
import torch
import torch.nn.functional as F

from kvwise.engine import cpu_kernel
from kvwise.engine.cpu_linear import MAX_ROWS, CpuLinears, onednn_linear

kernel = cpu_kernel.small_linear_kernel()
needs_kernel = pytest.mark.skipif(
    kernel is None and not os.environ.get("CI"), reason="no C++ compiler: the engine uses torch's linear here"
)


@pytest.fixture(scope="module", params=["native", "portable"])
def variant(request):
    if request.param == "native":
        return kernel
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the portable build's -march=x86-64 is for x86 machines")
    return cpu_kernel.build_kernel([*cpu_kernel.FLAGS, "-march=x86-64", "-mtune=generic"]).small_linear


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16, 17, 32, 33, 50, 64])  # 16-64: AVX-512 rows in lanes
@pytest.mark.parametrize(("features", "outputs"), [(64, 96), (75, 10), (576, 1538), (8, 3)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_torch_linear(variant, rows, features, outputs, with_bias):
    torch.manual_seed(rows * features + outputs)
    x, weight = torch.randn(rows, features), torch.randn(outputs, features)
    bias = torch.randn(outputs) if with_bias else None
    torch.testing.assert_close(variant(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_refuses_what_it_cannot_compute():
    with pytest.raises(RuntimeError, match="float32 only"):
        kernel(torch.ones(2, 4, dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64), None)
    with pytest.raises(RuntimeError, match="bad shapes"):
        kernel(torch.ones(2, 4), torch.ones(3, 5), None)


class Recorder:
    """Stands in for the kernel: counts calls and answers as torch would."""

    def __init__(self):
        self.rows = []

    def __call__(self, x, weight, bias):
        self.rows.append(x.shape[0])
        return F.linear(x, weight, bias)


def test_few_rows_take_the_kernel_and_the_model_is_restored():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4, bias=False))
    recorder = Recorder()
    linears = CpuLinears(model, recorder)
    few, many = torch.randn(1, MAX_ROWS, 8), torch.randn(1, MAX_ROWS + 1, 8)
    expected = model(few)
    with linears.active():
        torch.testing.assert_close(model(few), expected)
        model(many)
    assert recorder.rows == [MAX_ROWS, MAX_ROWS]  # both layers for `few`, neither for `many`
    assert all("forward" not in vars(layer) for layer in model)


def test_restored_after_an_error_and_wrapped_layers_are_left_alone():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    hooked = model[1].forward
    model[1].forward = hooked  # as accelerate's offloading hooks install themselves
    linears = CpuLinears(model, Recorder())
    assert linears.layers == [model[0]]
    with pytest.raises(RuntimeError), linears.active():
        model(torch.randn(2, 5))  # wrong width: the first layer fails
    assert "forward" not in vars(model[0]) and vars(model[1])["forward"] is hooked


def test_two_engines_on_one_model_can_leave_in_any_order():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    first, second = Recorder(), Recorder()
    engines = CpuLinears(model, first), CpuLinears(model, second)
    outer = engines[0].active()
    outer.__enter__()
    with engines[1].active():
        outer.__exit__(None, None, None)  # the first engine's forward ends while the second's runs
        model(torch.randn(2, 8))
    assert first.rows == [2] and not second.rows  # the layer kept the first swap until both ended
    assert "forward" not in vars(model[0])


def test_more_rows_take_onednn_and_match_torch():
    large = onednn_linear()
    if large is None:
        pytest.skip("this torch has no oneDNN linear")
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.Linear(96, 32, bias=False))
    recorder, calls = Recorder(), []

    def counted(x, weight, bias):
        calls.append(x.shape[0])
        return large(x, weight, bias)

    linears = CpuLinears(model, recorder, counted)
    many = torch.randn(1, 3 * MAX_ROWS, 48)
    expected = model(many)
    with linears.active():
        torch.testing.assert_close(model(many), expected, rtol=1e-5, atol=1e-5)
        model(many[:, :4])
    assert calls == [3 * MAX_ROWS, 3 * MAX_ROWS] and recorder.rows == [4, 4]
    assert all("forward" not in vars(layer) for layer in model)
