"""Causal prefill attention over paged KV (kernels/prefill_attention.cpp: float32 with AVX-512,
bfloat16 with AVX512-BF16) against float32 attention over the same values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvwise.engine import cpu_kernel

KERNELS = {dtype: cpu_kernel.prefill_attention_kernel(dtype) for dtype in (torch.float32, torch.bfloat16)}
kernel = KERNELS[torch.bfloat16]
needs_bf16 = pytest.mark.skipif(kernel is None, reason="no AVX512-BF16 here (or no compiler): SDPA runs")
pytestmark = pytest.mark.timeout(120)
# float32: products and sums in float32, in another order than SDPA's; bfloat16: the
# probabilities and the output rounded to bfloat16 (2^-8 each)
TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-6, atol=2e-2)}


def _reference(query, keys, values, table, start, scale):
    """float32 attention of query [T, H, D] at positions start.. over the sequence's first
    start + T keys gathered through `table`, each query seeing keys up to its position."""
    tokens, heads, dim = query.shape
    length = start + tokens
    k = keys.float()[table].flatten(0, 1)[:length].transpose(0, 1)  # [KVH, L, D]
    v = values.float()[table].flatten(0, 1)[:length].transpose(0, 1)
    seen = torch.arange(length)[None, :] <= torch.arange(start, length)[:, None]  # [T, L]
    return F.scaled_dot_product_attention(
        query.float().transpose(0, 1), k, v, attn_mask=seen, scale=scale, enable_gqa=True
    ).transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("start", "tokens"), [(0, 1), (0, 17), (0, 70), (20, 1), (37, 50), (64, 16)])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"), [(9, 3, 64, 16), (4, 4, 16, 4), (8, 2, 128, 32), (6, 2, 48, 16)]
)
def test_matches_float32_attention_over_the_same_values(dtype, start, tokens, heads, kv_heads, dim, block_size):
    if KERNELS[dtype] is None:
        pytest.skip(f"no {dtype} prefill kernel on this CPU (or no compiler): SDPA runs")
    generator = torch.Generator().manual_seed(start * 131 + tokens + dim)
    num_blocks = 24 * 16 // block_size + 4
    keys = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator).to(dtype)
    values = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator).to(dtype)
    blocks = -(-(start + tokens) // block_size)
    table = torch.randperm(num_blocks, generator=generator)[:blocks]  # scattered blocks
    query = (torch.randn(tokens, heads, dim, generator=generator) * 2).to(dtype)
    scale = dim**-0.5
    got = KERNELS[dtype](query, keys, values, table, start, scale)
    assert got.dtype == dtype and got.shape == query.shape
    expected = _reference(query, keys, values, table, start, scale)
    torch.testing.assert_close(got.float(), expected, **TOLERANCES[dtype])


@needs_bf16
def test_every_query_row_sees_only_its_past():
    """A key placed after a query's position, with a huge score, changes nothing for that query."""
    generator = torch.Generator().manual_seed(5)
    keys = torch.randn(4, 16, 1, 32, generator=generator).bfloat16()
    values = torch.randn(4, 16, 1, 32, generator=generator).bfloat16()
    query = torch.randn(40, 2, 32, generator=generator).bfloat16()
    table = torch.tensor([2, 0, 3])
    before = kernel(query, keys, values, table, 0, 0.2)
    keys[3, 7] = 50 * query[39, 0]  # key 39 (block 3 is the third in the table), aligned with query 39
    values[3, 7] = 100.0
    after = kernel(query, keys, values, table, 0, 0.2)
    assert torch.equal(before[:39], after[:39])
    assert (after[39] - before[39]).abs().max() > 1


@needs_bf16
def test_refuses_what_it_cannot_compute():
    pool = torch.zeros(2, 16, 1, 32, dtype=torch.bfloat16)
    query = torch.zeros(4, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="of one dtype"):
        kernel(query.float(), pool, pool, torch.tensor([0]), 0, 1.0)
    with pytest.raises(RuntimeError, match="shorter than the sequence"):
        kernel(query, pool, pool, torch.tensor([0]), 14, 1.0)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernel(query, pool, pool, torch.tensor([5]), 0, 1.0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel(torch.zeros(4, 2, 24, dtype=torch.bfloat16), pool[..., :24], pool[..., :24], torch.tensor([0]), 0, 1.0)


def _prompt_logprobs(model, ids: list[int], cpu_kernel: bool) -> torch.Tensor:
    """[n - 1] the engine's log-probabilities of ids[1:], the prompt prefilled 16 tokens a step
    (so later chunks start mid-sequence) into blocks of 4 tokens."""
    from kvwise.engine.config import CacheConfig
    from kvwise.engine.core import EngineCore
    from kvwise.engine.sampling import SamplingParams

    core = EngineCore(model, None, CacheConfig(block_size=4, num_blocks=128, token_budget=16), cpu_kernel=cpu_kernel)
    assert (core.runner.prefill_kernel is not None) == cpu_kernel
    request = core.make_request(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    core.add(request)
    while core.has_work:
        core.step()
    assert request.error is None
    return torch.tensor([next(iter(entry.values())) for entry in request.prompt_logprobs[1:]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_prefills_chunks_in_the_kernel_as_sdpa_does(dtype):
    from tests.conftest import TINY_MODELS, random_ids

    if KERNELS[dtype] is None:
        pytest.skip(f"no {dtype} prefill kernel on this CPU (or no compiler): SDPA runs")
    model = TINY_MODELS["llama"]().to(dtype)
    ids = random_ids(1, 70, seed=4)[0].tolist()
    in_kernel = _prompt_logprobs(model, ids, cpu_kernel=True)
    with_sdpa = _prompt_logprobs(model, ids, cpu_kernel=False)
    # bfloat16: both round the probabilities and the output to bfloat16, in different orders
    tolerance = 1e-4 if dtype == torch.float32 else 0.01
    torch.testing.assert_close(in_kernel, with_sdpa, atol=tolerance, rtol=0)


def test_only_plain_prefill_chunks_go_to_the_kernel():
    """Soft caps, windows that cut the chunk, quantized blocks, head regions, decodes and heads
    that are not whole vectors stay with SDPA."""
    from types import SimpleNamespace

    from kvwise.engine.runner import _prefills_in_kernel

    layout = SimpleNamespace(prefill_kernel=object())
    plain = dict(chunks=1, decodes=False, mixed=None, region=None, keys_per_chunk=40)

    def group(**change):
        return SimpleNamespace(**{**plain, **change})

    assert _prefills_in_kernel(group(), layout, None, None, 64)
    assert _prefills_in_kernel(group(), layout, 4096, None, 64)  # a window that cuts nothing
    assert not _prefills_in_kernel(group(), SimpleNamespace(prefill_kernel=None), None, None, 64)
    assert not _prefills_in_kernel(group(), layout, None, 50.0, 64)  # Gemma 2's soft cap
    assert not _prefills_in_kernel(group(), layout, 16, None, 64)  # a window shorter than the keys
    assert not _prefills_in_kernel(group(), layout, None, None, 72)
    assert not _prefills_in_kernel(group(mixed=object()), layout, None, None, 64)
    assert not _prefills_in_kernel(group(region=object()), layout, None, None, 64)
    assert not _prefills_in_kernel(group(decodes=True), layout, None, None, 64)
    assert not _prefills_in_kernel(group(chunks=2), layout, None, None, 64)
