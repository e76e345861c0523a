"""The paged model runner with the scheduler: greedy tokens equal transformers generate."""

from __future__ import annotations

import pytest
import torch

from kvwise.core.block_pool import BlockPool
from kvwise.core.radix import RadixCache
from kvwise.engine.kv_manager import KVCacheManager
from kvwise.engine.namespaces import default_namespace
from kvwise.engine.request import Request
from kvwise.engine.runner import ModelRunner
from kvwise.engine.sampling import SamplingParams
from kvwise.engine.scheduler import Scheduler
from kvwise.kv.paged import PagedKVStorage
from tests.conftest import random_ids

BLOCK = 4


def reference(model, prompts, max_tokens):
    # Gemma 2 caps attention logits, which only transformers' eager attention implements
    model.set_attn_implementation("eager" if getattr(model.config, "attn_logit_softcapping", None) else "sdpa")
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            outputs.append(model.generate(ids, max_new_tokens=max_tokens, do_sample=False)[0, len(prompt) :].tolist())
    return outputs


def engine(model, batches, max_tokens, budget=16, reuse=True, num_blocks=64, cpu_kernel=True):
    """Run `batches` of prompts, each batch added after the previous one finished."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    pool = BlockPool(num_blocks, BLOCK)
    storage = PagedKVStorage(config.num_hidden_layers, num_blocks, BLOCK, config.num_key_value_heads, head_dim)
    storage.attach(pool)
    kv = KVCacheManager(pool, RadixCache(pool) if reuse else None, default_namespace("tiny"), storage)
    scheduler = Scheduler(kv, token_budget=budget)
    runner = ModelRunner(model, kv.runner_view(), cpu_kernel=cpu_kernel)
    if cpu_kernel and runner.decode_kernel is None:
        pytest.skip("no CPU decode kernel on this machine (test_cpu_kernel says why)")
    results = []
    for prompts in batches:
        requests = [Request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens)) for prompt in prompts]
        for request in requests:
            scheduler.add(request)
        while scheduler.running or scheduler.waiting:
            step = scheduler.schedule()
            logits = runner.forward(step.chunks).logits
            for chunk, row in zip(step.chunks, logits):
                request = chunk.request
                scheduler.complete(chunk, int(row.argmax()) if chunk.end >= len(request.prompt) else None)
                if len(request.output) >= max_tokens and request in scheduler.running:
                    scheduler.finish(request)
        results.append(requests)
    return [[request.output for request in requests] for requests in results], results


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["cpu-kernel", "sdpa"])
def test_mixed_lengths_in_one_batch_match_generate(tiny_model, cpu_kernel):
    llama = tiny_model  # llama, qwen2, mistral
    prompts = [random_ids(1, length, seed=length)[0].tolist() for length in (5, 13, 22)]
    expected = reference(llama, prompts, 6)
    (outputs,), _ = engine(llama, [prompts], 6, budget=12, cpu_kernel=cpu_kernel)  # chunked prefill mixed with decodes
    assert outputs == expected


def test_reused_prefixes_give_the_same_tokens(llama):
    shared = random_ids(1, 16, seed=3)[0].tolist()
    first, second = shared + [5, 6, 7], shared + [9, 10]
    expected = reference(llama, [first, second], 5)
    outputs, requests = engine(llama, [[first], [second]], 5)
    assert outputs == [[expected[0]], [expected[1]]]
    assert requests[1][0].reused == 16  # the second prompt's shared 16 tokens came from the prefix cache


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["cpu-kernel", "sdpa"])
def test_sliding_window_and_softcapped_layers_match_generate(gemma2, cpu_kernel):
    """Gemma 2 alternates window-8 and full layers and caps attention logits; prompts longer than
    the window, chunked, with decodes in the same steps."""
    prompts = [random_ids(1, length, seed=length)[0].tolist() for length in (5, 13, 22)]
    expected = reference(gemma2, prompts, 8)
    (outputs,), _ = engine(gemma2, [prompts], 8, budget=12, cpu_kernel=cpu_kernel)
    assert outputs == expected


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["cpu-kernel", "sdpa"])
def test_sliding_window_without_softcap_matches_generate(cpu_kernel):
    from transformers import MistralConfig, MistralForCausalLM

    from tests.conftest import SHARED

    torch.manual_seed(0)
    mistral = MistralForCausalLM(MistralConfig(**SHARED, sliding_window=6, head_dim=16)).eval()
    prompts = [random_ids(1, length, seed=length)[0].tolist() for length in (4, 11, 19)]
    expected = reference(mistral, prompts, 8)
    (outputs,), _ = engine(mistral, [prompts], 8, budget=10, cpu_kernel=cpu_kernel)
    assert outputs == expected
