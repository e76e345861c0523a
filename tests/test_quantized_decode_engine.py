"""The engine decodes quantized requests with the CPU kernel reading their blocks in place, in
one call with the plain requests, and gives what the dequantize-then-attend path gives."""

from __future__ import annotations

import pytest
import torch

from kvwise.engine import runner as runner_module
from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.quant_pool import QuantPool
from kvwise.engine.sampling import SamplingParams
from tests.conftest import random_ids

pytestmark = pytest.mark.timeout(300)

MIXES = [None, "int8", "kivi4", "fp8", None, "kivi2", "int8"]


def _run(model, cpu_kernel: bool):
    """Every request's greedy tokens and the logits of every step, with MIXES on the requests."""
    core = EngineCore(model, None, CacheConfig(block_size=4, num_blocks=512, token_budget=512, prefix_caching=False))
    if not cpu_kernel:
        core.runner.decode_kernel = core.runner.quantized_kernel = core.runner.rows_kernel = None
    logits = []
    core.logits_observer = lambda chunks, rows: logits.append(rows.clone())
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [random_ids(1, 150 + 9 * index, seed=index)[0].tolist() for index in range(len(MIXES))]
    requests = [core.make_request(p, params, index, kv=mix) for index, (p, mix) in enumerate(zip(prompts, MIXES))]
    for request in requests:
        core.add(request)
    while core.has_work:
        core.step()
    return [request.output for request in requests], logits, core


def test_quantized_and_plain_requests_decode_together_as_the_reference_path(llama, monkeypatch):
    reference_tokens, reference_logits, _ = _run(llama, cpu_kernel=False)
    reads = []
    original = QuantPool.read
    monkeypatch.setattr(QuantPool, "read", lambda self, *args: reads.append(1) or original(self, *args))
    calls = []
    kernel = runner_module.quantized_decode_kernel()

    def counting(query, *args):
        calls.append(query.shape[0])  # sequences read in one call
        return kernel(query, *args)

    monkeypatch.setattr(runner_module, "quantized_decode_kernel", lambda: counting if kernel else None)
    tokens, logits, core = _run(llama, cpu_kernel=True)
    if core.runner.quantized_kernel is None:
        pytest.skip("no CPU decode kernel on this machine (test_cpu_kernel says why)")
    assert calls, "the quantized kernel never ran"
    assert not reads, "a quantized block was restored to full precision for decode"
    assert max(calls) > 1  # plain and quantized requests in one call
    assert tokens == reference_tokens
    assert len(logits) == len(reference_logits)
    for got, expected in zip(logits, reference_logits):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert core.kv.stats().quantized_bytes == 0  # all released at the end


def test_bfloat16_decodes_in_the_kernel_as_close_to_float32_as_sdpa_does(monkeypatch):
    """A bfloat16 model's plain and quantized requests decode in the kernel (SDPA before): its
    logits stay as close to the float32 model's as the SDPA path's do."""
    from tests.conftest import TINY_MODELS

    _, float32_logits, _ = _run(TINY_MODELS["llama"](), cpu_kernel=False)
    model = TINY_MODELS["llama"]().to(torch.bfloat16)
    _, sdpa_logits, _ = _run(model, cpu_kernel=False)
    calls = []
    kernel = runner_module.quantized_decode_kernel()
    monkeypatch.setattr(
        runner_module,
        "quantized_decode_kernel",
        lambda: (lambda *args: calls.append(args[1].dtype) or kernel(*args)) if kernel else None,
    )
    _, kernel_logits, core = _run(model, cpu_kernel=True)
    if core.runner.quantized_kernel is None:
        pytest.skip("no CPU decode kernel on this machine (test_cpu_kernel says why)")
    assert calls and set(calls) == {torch.bfloat16}
    sdpa_error = max((s.float() - f).abs().max() for s, f in zip(sdpa_logits, float32_logits))
    kernel_error = max((k.float() - f).abs().max() for k, f in zip(kernel_logits, float32_logits))
    assert kernel_error <= 1.5 * sdpa_error
