"""`full` must behave exactly like transformers' DynamicCache."""

import torch
from transformers import DynamicCache

from kvwise import KVWiseCache
from tests.conftest import random_ids


def test_full_matches_dynamic_cache(tiny_model):
    ids = random_ids(1, 40)
    more = random_ids(1, 6, seed=2)
    with torch.no_grad():
        reference = tiny_model(ids, cache=DynamicCache(config=tiny_model.config), use_cache=True)
        cache = KVWiseCache(tiny_model, "full")
        ours = tiny_model(ids, cache=cache, use_cache=True)
        assert torch.allclose(reference.logits, ours.logits, atol=1e-5)
        # a multi-token continuation, then single decode steps
        reference_next = tiny_model(more, cache=reference.cache, use_cache=True)
        ours_next = tiny_model(more, cache=cache, use_cache=True)
        assert torch.allclose(reference_next.logits, ours_next.logits, atol=1e-5)
        for token in random_ids(1, 3, seed=3).T:
            ref_step = tiny_model(token[None], cache=reference.cache, use_cache=True)
            our_step = tiny_model(token[None], cache=cache, use_cache=True)
            assert torch.allclose(ref_step.logits, our_step.logits, atol=1e-5)


def test_full_generate_matches_dynamic_cache(llama):
    ids = random_ids(2, 30)
    expected = llama.generate(ids, max_new_tokens=8, do_sample=False)
    cache = KVWiseCache(llama, "full")
    got = llama.generate(ids, cache=cache, max_new_tokens=8, do_sample=False)
    assert torch.equal(expected, got)


def test_kvwise_attention_without_kvwise_cache_matches_sdpa(llama):
    ids = random_ids(1, 20)
    with torch.no_grad():
        sdpa = llama(ids).logits
        KVWiseCache(llama, "full")  # switches the model to kvwise attention
        assert llama.config._attn_implementation == "kvwise"
        ours = llama(ids, cache=DynamicCache(config=llama.config), use_cache=True).logits
    assert torch.allclose(sdpa, ours, atol=1e-5)
