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
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])


def test_silu_mul_at_the_extremes():
    gate = torch.tensor([-1e4, -100.0, -87.0, 0.0, 87.0, 100.0, 1e4, float("inf"), float("-inf")])
    got = KERNELS[1](gate, torch.ones_like(gate))
    expected = F.silu(gate)
    assert torch.equal(got[3], expected[3]) and torch.isfinite(got[:7]).all()
    torch.testing.assert_close(got[:7], expected[:7], rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_a_model_with_its_norms_and_mlps_fused_gives_the_same_logits(name, dtype):
    model = TINY_MODELS[name]().to(dtype)
    fused = FusedLayers(model, *KERNELS)
    layers = model.config.num_hidden_layers
    assert len(fused.norms) == 2 * layers + 1 and len(fused.mlps) == layers and len(fused.rotary_files) == 1
    (modeling,) = fused.rotary_files
    original = modeling.apply_rotary_pos_emb
    ids = random_ids(1, 40)
    with torch.no_grad():
        expected = model(ids).logits
        with fused.active():
            assert getattr(modeling.apply_rotary_pos_emb, "kvwise_fused", False)
            got = model(ids).logits
        after = model(ids).logits
    assert torch.equal(after, expected)  # the model is as it was once the forward is done
    assert modeling.apply_rotary_pos_emb is original
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])
    assert not any("forward" in vars(module) for module in model.modules())


def test_norms_and_mlps_that_compute_something_else_keep_their_code(gemma2):
    """Gemma's norm multiplies by 1 + weight, and its MLP is GELU-gated: the probe rejects both
    (its rotary embedding is the usual one)."""
    fused = FusedLayers(gemma2, *KERNELS)
    assert not fused.norms and not fused.mlps and len(fused.rotary_files) == 1


def test_a_partial_rotary_embedding_keeps_its_code(monkeypatch):
    """A modeling file whose rotary function rotates only part of each head is left alone."""
    from transformers.models.llama import modeling_llama

    model = TINY_MODELS["llama"]()
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", _partial(modeling_llama.apply_rotary_pos_emb))
    assert FusedLayers(model, *KERNELS).rotary_files == []


def _partial(full):
    """`full` applied to the first half of each head only (Phi's and GPT-NeoX's partial rotary)."""

    def partial_rotary(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        half = q.shape[-1] // 2
        q_rot, k_rot = full(q[..., :half], k[..., :half], cos[..., :half], sin[..., :half])
        return torch.cat([q_rot, q[..., half:]], -1), torch.cat([k_rot, k[..., half:]], -1)

    return partial_rotary


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
