"""Positions survive eviction; padded batches keep and count no padding."""

import pytest
import torch

from kvwise import KVWiseCache
from tests.conftest import random_ids


def test_new_tokens_continue_from_original_length(llama):
    ids = random_ids(1, 50)
    cache = KVWiseCache(llama, "snapkv", compression_ratio=0.8, window_size=4)
    with torch.no_grad():
        cache.compress_context(ids)
        assert cache.get_seq_length() == 50
        layer = cache.compressing_layers[0]
        kept_positions = layer.positions.clone()
        assert kept_positions.max() < 50 and len(set(kept_positions.tolist())) <= 50
        llama(random_ids(1, 3, seed=5), cache=cache, use_cache=True)
    # the three new tokens sit at positions 50, 51, 52 in every head
    positions = layer.positions.view(1, 2, -1)
    assert positions[0, :, -3:].tolist() == [[50, 51, 52]] * 2
    assert cache.get_seq_length() == 53


def test_kept_keys_are_the_original_rotated_keys(llama):
    """Eviction must not re-rotate: a kept key equals the key computed at its original position."""
    from transformers import DynamicCache

    ids = random_ids(1, 40)
    with torch.no_grad():
        reference = DynamicCache(config=llama.config)
        llama(ids, cache=reference, use_cache=True)
        cache = KVWiseCache(llama, "knorm", compression_ratio=0.5)
        cache.compress_context(ids)
    layer = cache.compressing_layers[1]
    keys = layer.store.residual_keys.view(1, 2, 20, -1)
    positions = layer.positions.view(1, 2, 20).long()
    expected = reference.layers[1].keys.gather(2, positions[..., None].expand(-1, -1, -1, keys.shape[-1]))
    assert torch.allclose(keys, expected, atol=1e-6)


def test_compressed_answer_matches_full_when_nothing_relevant_is_evicted(llama):
    """Evicting nothing (ratio 0) through the compressing path equals the full cache."""
    ids = random_ids(1, 32)
    full = llama.generate(ids, cache=KVWiseCache(llama, "full"), max_new_tokens=6, do_sample=False)
    zero = llama.generate(
        ids, cache=KVWiseCache(llama, "snapkv", compression_ratio=0.0), max_new_tokens=6, do_sample=False
    )
    assert torch.equal(full, zero)


def test_left_padded_batch_matches_unpadded_rows(llama):
    long_ids, short_ids = random_ids(1, 30, seed=1), random_ids(1, 20, seed=2)
    batch = torch.cat([long_ids, torch.cat([torch.zeros(1, 10, dtype=torch.long), short_ids], 1)])
    mask = torch.ones_like(batch)
    mask[1, :10] = 0
    cache = KVWiseCache(llama, "snapkv", compression_ratio=0.5, window_size=4)
    batched = llama.generate(batch, attention_mask=mask, cache=cache, max_new_tokens=5, do_sample=False)
    kept = cache.kept_tokens()[0]
    # 15 of 30 and 10 of 20 real tokens, plus 4 fed-back tokens; padding neither kept nor counted
    assert kept.tolist() == [[19, 19], [14, 14]]
    layer = cache.compressing_layers[0]
    assert layer.store.residual_keys.shape[0] == (19 + 14) * 2
    for row, ids in ((0, long_ids), (1, short_ids)):
        single = KVWiseCache(llama, "snapkv", compression_ratio=0.5, window_size=4)
        alone = llama.generate(ids, cache=single, max_new_tokens=5, do_sample=False)
        assert batched[row, -5:].tolist() == alone[0, -5:].tolist()


def test_uneven_layers_survive_multi_token_continuation(llama):
    """PyramidKV leaves layers at different lengths; a multi-token forward must still work."""
    from transformers import DynamicCache

    ids = random_ids(1, 64)
    cache = KVWiseCache(llama, "pyramidkv", compression_ratio=0.5)
    with torch.no_grad():
        cache.compress_context(ids)
        lengths = {int(c[0, 0]) for c in cache.kept_tokens().values()}
        assert len(lengths) == 3
        out = llama(random_ids(1, 7, seed=6), cache=cache, use_cache=True)
    assert torch.isfinite(out.logits).all()
    del DynamicCache


def test_sliding_layers_keep_window_semantics(gemma2):
    from transformers.cache_utils import DynamicSlidingWindowLayer

    ids = random_ids(1, 40)
    cache = KVWiseCache(gemma2, "snapkv", compression_ratio=0.75, window_size=4)
    with torch.no_grad():
        cache.compress_context(ids)
        gemma2(random_ids(1, 3, seed=8), cache=cache, use_cache=True)
    sliding = [layer for layer in cache.layers if isinstance(layer, DynamicSlidingWindowLayer)]
    assert len(sliding) == 2 and len(cache.compressing_layers) == 2
    for layer in sliding:
        assert layer.keys.shape[-2] <= 8 + 3  # the window (transformers keeps window - 1 + new tokens)
    for counts in cache.kept_tokens().values():
        assert (counts == 10 + 3).all()  # the budget applies to the full-attention layers only


def test_gemma2_full_matches_dynamic_cache(gemma2):
    from transformers import DynamicCache

    ids = random_ids(1, 24)
    with torch.no_grad():
        gemma2.set_attn_implementation("eager")
        reference = gemma2(ids, cache=DynamicCache(config=gemma2.config), use_cache=True)
        ref_next = gemma2(random_ids(1, 2, seed=3), cache=reference.cache, use_cache=True)
        cache = KVWiseCache(gemma2, "full")
        ours = gemma2(ids, cache=cache, use_cache=True)
        our_next = gemma2(random_ids(1, 2, seed=3), cache=cache, use_cache=True)
    assert torch.allclose(reference.logits, ours.logits, atol=1e-4)
    assert torch.allclose(ref_next.logits, our_next.logits, atol=1e-4)


@pytest.mark.parametrize("policy", ["h2o", "scissorhands", "tova", "streaming_llm", "keydiff"])
def test_each_batch_row_keeps_what_it_would_alone(llama, policy):
    # Budget-derived windows (H2O's recent half) and attention sums must be per row: a padded
    # row once borrowed the longest row's window, and padding queries voted for tokens.
    short, long = random_ids(1, 30, seed=4), random_ids(1, 45, seed=5)
    batch = torch.cat([torch.cat([torch.zeros(1, 15, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :15] = 0
    with torch.no_grad():
        together = llama.generate(
            batch, attention_mask=mask, cache=KVWiseCache(llama, policy, 0.5), max_new_tokens=6, do_sample=False
        )
        for row, ids in enumerate([short, long]):
            alone = llama.generate(ids, cache=KVWiseCache(llama, policy, 0.5), max_new_tokens=6, do_sample=False)
            assert together[row, -6:].tolist() == alone[0, -6:].tolist()
