"""RMSNorm, SiLU(gate) * up and rotary embedding in one pass each (kernels/elementwise.cpp), and
the modules the runner swaps to them (engine/fused_layers.py): only those whose own forward the
kernel reproduces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvwise.engine import cpu_kernel
from kvwise.engine.fused_layers import FusedLayers
from tests.conftest import TINY_MODELS, random_ids

KERNELS = cpu_kernel.elementwise_kernels()
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(KERNELS is None, reason="no AVX-512 here (or no compiler): transformers' forwards run"),
]
# float32: a sum in another order; bfloat16: plus a rounding that may land one unit apart (2^-8)
TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-7, atol=2**-7)}


def _reference_rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm: in float32, rounded to x's dtype before the weight multiplies."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(1, 576), (7, 100), (3, 8), (300, 576)])
def test_rms_norm_matches_transformers(dtype, rows, width):
    shape = (rows, width)
    generator = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(shape, generator=generator) * 3).to(dtype)
    weight = torch.randn(width, generator=generator).to(dtype)
    got = KERNELS[0](x, weight, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), _reference_rms_norm(x, weight, 1e-5).float(), **TOLERANCES[dtype])


def test_rms_norm_takes_any_leading_shape_and_a_tiny_row():
    x = torch.randn(2, 5, 64)
    weight = torch.rand(64)
    torch.testing.assert_close(KERNELS[0](x, weight, 1e-6), _reference_rms_norm(x, weight, 1e-6))
    zeros = torch.zeros(1, 64)  # eps keeps it finite
    assert torch.equal(KERNELS[0](zeros, weight, 1e-6), zeros)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", [1, 15, 16, 1536 * 3, 1536 * 40 + 5])
def test_silu_mul_matches_torch(dtype, count):
    generator = torch.Generator().manual_seed(count)
    gate = (torch.randn(count, generator=generator) * 6).to(dtype)  # into exp's tails
    up = torch.randn(count, generator=generator).to(dtype)
    got = KERNELS[1](gate, up)
    assert got.dtype == dtype and got.shape == gate.shape
    torch.testing.assert_close(got.float(), (F.silu(gate) * up).float(), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "tokens", "dim"), [(9, 1, 64), (3, 37, 64), (2, 5, 24), (4, 300, 128)])
def test_rotary_matches_transformers(dtype, heads, tokens, dim):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(heads * tokens + dim)
    # a projection's output viewed as heads: [1, tokens, heads, dim] transposed, rows contiguous
    x = torch.randn(1, tokens, heads, dim, generator=generator).to(dtype).transpose(1, 2)
    angles = torch.rand(1, tokens, dim // 2, generator=generator) * 100
    cos, sin = (part(torch.cat([angles, angles], -1)).to(dtype) for part in (torch.cos, torch.sin))
    got = KERNELS[2](x, cos, sin)
    expected, _ = apply_rotary_pos_emb(x, x, cos, sin)
    assert got.shape == x.shape and got.dtype == dtype
    assert got.transpose(1, 2).is_contiguous()  # laid out as the paged pool stores keys
    if dtype == torch.bfloat16:  # products of bfloat16 values are exact in float32: every rounding is torch's
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


def test_silu_mul_at_the_extremes():
    gate = torch.tensor([-1e4, -100.0, -87.0, 0.0, 87.0, 100.0, 1e4, float("inf"), float("-inf")])
    got = KERNELS[1](gate, torch.ones_like(gate))
    expected = F.silu(gate)
    assert torch.equal(got[3], expected[3]) and torch.isfinite(got[:7]).all()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-30, equal_nan=True)  # silu(-inf) is NaN in torch


class _Counted:
    """A kernel that counts its calls."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def __call__(self, *args):
        self.calls += 1
        return self.kernel(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_a_model_with_its_norms_and_mlps_fused_gives_the_same_logits(name, dtype):
    model = TINY_MODELS[name]().to(dtype)
    kernels = [_Counted(kernel) for kernel in KERNELS]
    fused = FusedLayers(model, *kernels)
    layers = model.config.num_hidden_layers
    assert len(fused.norms) == 2 * layers + 1 and len(fused.mlps) == layers and len(fused.rotary_files) == 1
    (modeling,) = fused.rotary_files
    original = modeling.apply_rotary_pos_emb
    ids = random_ids(1, 40)
    with torch.no_grad():
        expected = model(ids).logits
        before = [kernel.calls for kernel in kernels]  # the probes' calls
        with fused.active():
            assert getattr(modeling.apply_rotary_pos_emb, "kvwise_fused", False)
            got = model(ids).logits
        calls = [kernel.calls - count for kernel, count in zip(kernels, before)]
        after = model(ids).logits
    assert calls == [2 * layers + 1, layers, 2 * layers]  # every norm, MLP and rotary went through a kernel
    assert torch.equal(after, expected)  # the model is as it was once the forward is done
    assert modeling.apply_rotary_pos_emb is original
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])
    assert not any("forward" in vars(module) for module in model.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_mlps_that_compute_something_else_keep_their_code(gemma2, dtype):
    """Gemma's norm multiplies by 1 + weight, and its MLP is GELU-gated: the probe rejects both
    (its rotary embedding is the usual one)."""
    fused = FusedLayers(gemma2.to(dtype), *KERNELS)
    assert not fused.norms and not fused.mlps and len(fused.rotary_files) == 1


class _MeanCentredNorm(torch.nn.Module):
    """Cohere's layer norm: an RMSNorm's attributes, but the mean is taken out first."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))
        self.variance_epsilon = 1e-5

    def forward(self, x):
        centred = x - x.mean(-1, keepdim=True)
        return self.weight * centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


class _ClampedSwiGLU(torch.nn.Module):
    """A gated SiLU MLP whose gate and up are clamped (DeepSeek V4's swiglu_limit)."""

    def __init__(self, width: int, limit: float = 7.0):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(width, 2 * width), torch.nn.Linear(width, 2 * width)
        self.down_proj, self.act_fn, self.limit = torch.nn.Linear(2 * width, width), torch.nn.SiLU(), limit

    def forward(self, x):
        gate = self.gate_proj(x).clamp(max=self.limit)
        return self.down_proj(self.act_fn(gate) * self.up_proj(x).clamp(-self.limit, self.limit))


def test_a_mean_centred_norm_and_a_clamped_mlp_keep_their_code():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_MeanCentredNorm(64), _ClampedSwiGLU(64))
    fused = FusedLayers(model, *KERNELS)
    assert not fused.norms and not fused.mlps


def test_a_rotary_call_for_part_of_each_head_or_a_shared_cos_row_goes_to_transformers(monkeypatch):
    """transformers' partial rotary files take the rotated width from cos: with full-width cos
    they compute the usual rotary (the probe passes), so at run time a narrower cos, or one cos row
    for a batch, must reach the original function."""
    from transformers.models.llama import modeling_llama

    def partial_rotary(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        width = cos.shape[-1]

        def rotate(x):
            rotated, passed = x[..., :width], x[..., width:]
            embedded = rotated * cos + modeling_llama.rotate_half(rotated) * sin
            return torch.cat([embedded, passed], -1)

        return rotate(q), rotate(k)

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", partial_rotary)
    model = TINY_MODELS["llama"]()
    kernels = [_Counted(kernel) for kernel in KERNELS]
    fused = FusedLayers(model, *kernels)
    assert list(fused.rotary_files.values()) == [partial_rotary]
    generator = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 5, 16, generator=generator), torch.randn(2, 2, 5, 16, generator=generator)
    narrow = torch.randn(2, 5, 8, generator=generator)
    shared = torch.randn(1, 5, 16, generator=generator)
    with fused.active():
        before = kernels[2].calls
        for angles in (narrow, shared):
            got = modeling_llama.apply_rotary_pos_emb(q, k, angles.cos(), angles.sin())
            expected = partial_rotary(q, k, angles.cos(), angles.sin())
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert kernels[2].calls == before


def test_two_runners_on_one_model_can_enter_and_leave_in_any_order():
    from transformers.models.llama import modeling_llama

    model = TINY_MODELS["llama"]()
    original = modeling_llama.apply_rotary_pos_emb
    first, second = FusedLayers(model, *KERNELS), FusedLayers(model, *KERNELS)
    ids = random_ids(1, 20)
    with torch.no_grad():
        expected = model(ids).logits
        outer = first.active()
        outer.__enter__()
        with second.active():
            outer.__exit__(None, None, None)  # the first leaves while the second still runs
            assert "forward" in vars(first.norms[0]) and modeling_llama.apply_rotary_pos_emb is not original
            torch.testing.assert_close(model(ids).logits, expected)
    assert not any("forward" in vars(module) for module in model.modules())
    assert modeling_llama.apply_rotary_pos_emb is original


def test_a_tensor_that_needs_gradients_takes_transformers_path():
    model = TINY_MODELS["llama"]()
    fused = FusedLayers(model, *KERNELS)
    norm = fused.norms[0]
    x = torch.randn(3, 64, requires_grad=True)
    with fused.active():
        out = norm(x)
    out.sum().backward()  # the kernel keeps no graph; transformers' forward does
    assert x.grad is not None


def test_the_engine_runs_with_fused_layers_and_answers_as_without(llama):
    from kvwise.engine.config import CacheConfig
    from kvwise.engine.llm import LLM
    from kvwise.engine.sampling import SamplingParams

    prompts = [random_ids(1, 30, seed=seed)[0].tolist() for seed in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = LLM(llama, CacheConfig(block_size=16, num_blocks=64, token_budget=128))
    assert engine.engine.runner.fused_layers is not None
    outputs = engine.generate(prompts, params, use_tqdm=False)
    llama.set_attn_implementation("sdpa")
    with torch.no_grad():
        for prompt, output in zip(prompts, outputs):
            ids = torch.tensor([prompt])
            expected = llama.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(prompt) :]
            assert output.outputs[0].token_ids == expected.tolist()
