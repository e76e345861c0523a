"""Compress once, reuse many: a compressed (and quantized) context stored in a tier and loaded back."""

from __future__ import annotations

import torch

from kvwise import KVWiseCache, make_quantizer
from kvwise.hf.compressed_contexts import CompressedContexts
from kvwise.tiers.disk import DiskTier
from kvwise.tiers.host import HostTier
from tests.conftest import random_ids


def continue_with(model, cache, context, question):
    with torch.no_grad():
        return model.generate(torch.cat([context, question], 1), cache=cache, max_new_tokens=8, do_sample=False)


def test_a_loaded_context_generates_exactly_like_the_original(llama, tmp_path):
    context, question = random_ids(1, 60, seed=3), random_ids(1, 6, seed=4)
    quant = make_quantizer("kivi4", group_size=4, residual_length=8)
    contexts = CompressedContexts(DiskTier(tmp_path), tenant="alice")
    original = contexts.get_or_compress(llama, context, "snapkv", 0.5, quant=quant)
    assert contexts.misses == 1 and contexts.hits == 0
    expected = continue_with(llama, original, context, question)
    for _ in range(2):  # every load is a fresh cache
        loaded = contexts.get_or_compress(llama, context, "snapkv", 0.5, quant=quant)
        assert continue_with(llama, loaded, context, question).tolist() == expected.tolist()
    assert contexts.hits == 2


def test_the_key_includes_policy_ratio_quantizer_and_tenant(llama):
    context = random_ids(1, 40, seed=5)
    tier = HostTier(capacity_bytes=1 << 30)
    contexts = CompressedContexts(tier, tenant="alice")
    cache = KVWiseCache(llama, "snapkv", 0.5)
    with torch.no_grad():
        cache.compress_context(context)
    assert contexts.save(cache, context)
    assert contexts.load(llama, context, "snapkv", 0.5) is not None
    assert contexts.load(llama, context, "snapkv", 0.75) is None
    assert contexts.load(llama, context, "h2o", 0.5) is None
    assert contexts.load(llama, context, "snapkv", 0.5, window_size=8) is None  # other hyperparameters
    assert contexts.load(llama, context, "snapkv", 0.5, quant="int8") is None
    assert CompressedContexts(tier, tenant="bob").load(llama, context, "snapkv", 0.5) is None
    assert contexts.load(llama, random_ids(1, 40, seed=6), "snapkv", 0.5) is None
