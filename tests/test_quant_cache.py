"""Quantized storage in the cache: residual window, no re-quantization, honest bytes, composition."""

from __future__ import annotations

import pytest
import torch

from kvwise import KVWiseCache, make_quantizer
from kvwise.kv.blocks import QuantizedBlocks
from kvwise.kv.store import KVStore
from tests.conftest import random_ids

R, G = 16, 4


def feed(store: KVStore, keys: torch.Tensor, values: torch.Tensor, chunk: int) -> None:
    """Append [batch, heads, T, dim] rows `chunk` tokens at a time, keeping everything."""
    for start in range(0, keys.shape[2], chunk):
        old_keys, old_values, old_valid = store.padded()
        new_keys, new_values = keys[:, :, start : start + chunk], values[:, :, start : start + chunk]
        keep = torch.cat([old_valid, torch.ones(new_keys.shape[:3], dtype=torch.bool)], dim=2)
        store.commit(torch.cat([old_keys, new_keys], 2), torch.cat([old_values, new_values], 2), keep)


def kv(batch=2, heads=3, length=70, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, length, dim, generator=generator), torch.randn(
        batch, heads, length, dim, generator=generator
    )


@pytest.mark.parametrize("chunk", [1, 7, 70])
def test_residual_window_keeps_the_last_tokens_bit_exact(chunk):
    keys, values = kv()
    store = KVStore(keys, values, make_quantizer("kivi2", group_size=G, residual_length=R))
    feed(store, keys, values, chunk)
    restored_keys, restored_values, valid = store.padded()
    assert valid.all()
    assert torch.equal(restored_keys[:, :, :1], keys[:, :, :1])  # the sink stays exact
    residual = store.residual_lengths
    assert ((residual >= R) & (residual < R + G)).all()
    # keys left the window a whole group at a time; the first token became the head's sink
    assert (store.sink_lengths == 1).all()
    assert int(store.sink_lengths[0, 0] + store.quantized_lengths[0, 0]) % G == 0
    tail = int(residual.min())
    assert torch.equal(restored_keys[:, :, -tail:], keys[:, :, -tail:])
    assert torch.equal(restored_values[:, :, -tail:], values[:, :, -tail:])
    assert not torch.equal(restored_keys[:, :, 1:G], keys[:, :, 1:G])  # the old part really is quantized


@pytest.mark.parametrize("quant", ["kivi2", "kivi4", "int8", "fp8"])
def test_nothing_is_quantized_twice(quant, monkeypatch):
    quantizer = (
        make_quantizer(quant)
        if quant.startswith("int") or quant == "fp8"
        else make_quantizer(quant, group_size=G, residual_length=R)
    )
    encoded_rows = []
    for codec in {
        id(quantizer.key_codec): quantizer.key_codec,
        id(quantizer.value_codec): quantizer.value_codec,
    }.values():
        original = codec.encode

        def spy(rows, group_sizes=None, original=original):
            encoded_rows.append(rows.shape[0])
            return original(rows, group_sizes)

        monkeypatch.setattr(codec, "encode", spy)
    keys, values = kv()
    store = KVStore(keys, values, quantizer)
    feed(store, keys, values, chunk=3)
    store.flush()
    total = keys.shape[0] * keys.shape[1] * keys.shape[2] - int(store.sink_lengths.sum())
    assert int(store.quantized_lengths.sum()) == total and int(store.residual_lengths.sum()) == 0
    # every token's key and value went through a codec exactly once
    assert sum(encoded_rows) == 2 * total == store.quantize_calls


def test_eviction_inside_quantized_groups_copies_codes():
    keys, values = kv(batch=1, heads=2, length=40)
    store = KVStore(keys, values, make_quantizer("kivi4", group_size=G, residual_length=R, sink_tokens=0))
    feed(store, keys, values, chunk=40)
    before_keys, before_values, valid = store.padded()
    calls = store.quantize_calls
    keep = valid.clone()
    assert store.key_groups.tolist() == [[6, 6]]  # 24 quantized tokens per head, groups of 4
    keep[0, 0, 1:3] = False  # part of group 0 of head 0 ...
    keep[0, 0, 4:8] = False  # ... and all of its group 1, which disappears
    keep[0, 1, 0:3] = False
    store.commit(before_keys, before_values, keep)
    after_keys, _, _ = store.padded()
    assert store.quantize_calls == calls
    assert torch.equal(after_keys[0, 0, : keep[0, 0].sum()], before_keys[0, 0][keep[0, 0]])
    assert torch.equal(after_keys[0, 1, : keep[0, 1].sum()], before_keys[0, 1][keep[0, 1]])
    assert store.key_groups.tolist() == [[5, 6]]
    assert store.quantized_keys.group_sizes.tolist() == [2, 4, 4, 4, 4, 1, 4, 4, 4, 4, 4]


def test_kivi4_bytes_are_what_the_layout_says():
    keys, values = kv(batch=1, heads=2, length=64, dim=16)
    store = KVStore(keys, values, make_quantizer("kivi4", group_size=G, residual_length=R))
    feed(store, keys, values, chunk=64)
    quantized, residual = int(store.quantized_lengths.sum()), int(store.residual_lengths.sum())
    sinks = int(store.sink_lengths.sum())
    assert sinks == 2
    groups = int(store.key_groups.sum())
    assert groups == 2 * ((64 - R - 1 + G - 1) // G)
    expected = (
        quantized * 2 * (16 * 4 // 8)  # packed 4-bit key and value codes
        + groups * 16 * 2 * 2  # key min and scale per channel and group, float16
        + groups * 2  # int16 group sizes
        + quantized * 2 * 2  # value min and scale per token (one channel group of 16), float16
        + (residual + sinks) * 2 * 16 * 4  # full-precision residual and sink keys and values, float32
        + 5 * 2 * 8  # lengths and group counts, [1, 2] int64 each
        + len(store._quantized_parts()) * 3 * 2 * 8  # each quantized chunk's tokens and groups per head
    )
    assert store.nbytes() == expected


def test_cache_bytes_are_the_sum_of_its_tensors(llama):
    cache = KVWiseCache(llama, "snapkv", compression_ratio=0.5, quant="kivi2")
    with torch.no_grad():
        cache.compress_context(random_ids(1, 80))
    total = 0
    for layer in cache.compressing_layers:
        store = layer.store
        tensors = [store.residual_keys, store.residual_values, store.sink_keys, store.sink_values, layer.positions]
        tensors += [store.residual_lengths, store.quantized_lengths, store.sink_lengths]
        tensors += [store.key_groups, store.value_groups]
        for encoded in (store.quantized_keys, store.quantized_values):  # (merges the chunks)
            tensors += [*encoded.per_token.values(), *encoded.per_group.values()]
            tensors += [] if encoded.group_sizes is None else [encoded.group_sizes]
        tensors += [store._base.tokens, store._base.key_groups, store._base.value_groups]
        total += sum(t.numel() * t.element_size() for t in tensors)
        assert store.residual_keys.shape[0] == 0  # compress_context quantizes the whole context
    assert cache.nbytes() == total


def test_evict_then_quantize_composes(tiny_model):
    ids = random_ids(1, 200)
    plain = KVWiseCache(tiny_model, "snapkv", compression_ratio=0.75)
    mixed = KVWiseCache(tiny_model, "snapkv", compression_ratio=0.75, quant="kivi4")
    with torch.no_grad():
        plain.compress_context(ids)
        mixed.compress_context(ids)
    page, sinks = 32, 1  # kivi4's key group, and its one sink per head
    for (_, kept_plain), (_, kept_mixed) in zip(plain.kept_tokens().items(), mixed.kept_tokens().items()):
        # the policy chose, the quantizer stored: the page the last tokens start is filled
        assert torch.equal(kept_mixed, sinks + (kept_plain - sinks + page - 1) // page * page)
    for plain_layer, mixed_layer in zip(plain.compressing_layers, mixed.compressing_layers):
        held = [(layer.kept_positions()[0], layer.padded()[2][0]) for layer in (plain_layer, mixed_layer)]
        (plain_positions, plain_valid), (mixed_positions, mixed_valid) = held
        for head in range(plain_positions.shape[0]):  # filling only adds: every token the policy kept stays
            kept = set(plain_positions[head][plain_valid[head]].tolist())
            assert kept <= set(mixed_positions[head][mixed_valid[head]].tolist())
    assert mixed.nbytes() < 0.5 * plain.nbytes()
    stats = mixed.stats()
    assert stats["quantizer"] == "kivi4" and len(stats["layers"]) == len(mixed.compressing_layers)
    assert 0 < stats["key_relative_error"] < 0.2 and 0 < stats["value_relative_error"] < 0.2
    assert 0 < stats["attention_relative_error"] < 0.3
    with torch.no_grad():
        out = tiny_model.generate(
            torch.cat([ids, random_ids(1, 5, seed=3)], 1), cache=mixed, max_new_tokens=20, do_sample=False
        )
    assert out.shape[1] == 200 + 5 + 20
    assert mixed.stats()["layers"][0]["residual_tokens"] == 2 * (5 + 19)  # new tokens stay exact for now


def test_a_window_longer_than_the_text_changes_nothing(llama):
    ids = random_ids(2, 30)
    full = KVWiseCache(llama, "full")
    quant = KVWiseCache(llama, "full", quant=make_quantizer("kivi2", residual_length=128))
    with torch.no_grad():
        expected = llama.generate(ids, cache=full, max_new_tokens=10, do_sample=False)
        got = llama.generate(ids, cache=quant, max_new_tokens=10, do_sample=False)
    assert torch.equal(expected, got)
    assert quant.stats()["key_relative_error"] is None


@pytest.mark.parametrize("quant", ["int8", "fp8", "kivi4"])
def test_quantized_logits_stay_close(llama, quant):
    ids = random_ids(1, 90)
    quantizer = make_quantizer(quant) if quant != "kivi4" else make_quantizer(quant, group_size=8, residual_length=16)
    results = []
    for cache in (KVWiseCache(llama, "full"), KVWiseCache(llama, "full", quant=quantizer)):
        with torch.no_grad():
            llama(ids[:, :80], cache=cache, use_cache=True)
            results.append(llama(ids[:, 80:], cache=cache, use_cache=True).logits)
    relative = (results[1] - results[0]).norm() / results[0].norm()
    assert 0 < relative < {"int8": 0.01, "fp8": 0.05, "kivi4": 0.1}[quant]


def test_batched_quantized_matches_one_by_one(llama):
    short, long = random_ids(1, 30, seed=4), random_ids(1, 45, seed=5)
    batch = torch.cat([torch.cat([torch.zeros(1, 15, dtype=torch.long), short], 1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 15), torch.ones(1, 30)], 1), torch.ones(1, 45)]).long()
    quantizer = make_quantizer("kivi4", group_size=4, residual_length=8)
    with torch.no_grad():
        together = llama.generate(
            batch,
            attention_mask=mask,
            cache=KVWiseCache(llama, "h2o", 0.5, quant=quantizer),
            max_new_tokens=8,
            do_sample=False,
        )
        for row, ids in enumerate([short, long]):
            alone = llama.generate(
                ids, cache=KVWiseCache(llama, "h2o", 0.5, quant=quantizer), max_new_tokens=8, do_sample=False
            )
            assert torch.equal(together[row, -8:], alone[0, -8:])


def test_decode_budget_with_quantization(llama):
    cache = KVWiseCache(
        llama, "streaming_llm", max_kv_tokens=24, quant=make_quantizer("kivi2", group_size=4, residual_length=8)
    )
    with torch.no_grad():
        llama.generate(random_ids(1, 20), cache=cache, max_new_tokens=30, do_sample=False)
    for counts in cache.kept_tokens().values():
        assert (counts <= 24).all()
    assert all(layer["quantized_tokens"] > 0 for layer in cache.stats()["layers"])


def test_quantized_blocks_round_trip_and_zeroing():
    quantizer = make_quantizer("kivi4")
    blocks = QuantizedBlocks(quantizer, num_blocks=6, block_size=16, num_kv_heads=2, head_dim=64)
    keys, values = torch.randn(2, 16, 2, 64), torch.randn(2, 16, 2, 64)
    ids = torch.tensor([4, 1])
    blocks.write(ids, keys, values)
    restored_keys, restored_values = blocks.read(ids, torch.float32)
    assert restored_keys.shape == keys.shape
    assert (restored_keys - keys).norm() / keys.norm() < 0.15
    assert (restored_values - values).norm() / values.norm() < 0.15
    # 4-bit codes + float16 metadata: well under a third of the float32 rows' bytes
    assert blocks.nbytes() < 0.2 * 6 * 16 * 2 * 64 * 4 * 2
    blocks.zero(torch.tensor([4]))
    zeroed_keys, zeroed_values = blocks.read(torch.tensor([4]), torch.float32)
    assert not zeroed_keys.any() and not zeroed_values.any()
    with pytest.raises(ValueError, match="holds 16 tokens"):
        blocks.write(ids, keys[:, :8], values[:, :8])
