"""Every policy keeps exactly its budget, and the bytes it reports are the bytes it holds."""

import pytest
import torch

from kvwise import KVWiseCache, policy_names
from kvwise.hf.layer import CompressingLayer
from tests.conftest import random_ids

pytestmark = pytest.mark.usefixtures("kvzap_surrogate")  # kvzap runs on a random surrogate

EVICTING = [name for name in policy_names() if name not in ("full", "quest")]
LENGTH = 60


def layer_tensor_bytes(cache):
    total = 0
    for layer in cache.layers:
        assert isinstance(layer, CompressingLayer)
        store = layer.store
        tensors = [store.residual_keys, store.residual_values, store.residual_lengths, store.quantized_lengths]
        tensors += [layer.positions, *layer.stats.values()]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


@pytest.mark.parametrize("policy", EVICTING)
@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_policy_keeps_its_budget(tiny_model, policy, ratio):
    cache = KVWiseCache(tiny_model, policy, compression_ratio=ratio)
    with torch.no_grad():
        cache.compress_context(random_ids(1, LENGTH))
    kept = cache.kept_tokens()
    num_heads = tiny_model.config.num_key_value_heads
    per_head = round((1 - ratio) * LENGTH)
    total = sum(int(counts.sum()) for counts in kept.values())
    assert total == per_head * num_heads * len(kept)
    if cache.policy.budget_scope == "head" and policy != "pyramidkv":
        for counts in kept.values():
            assert (counts == per_head).all()
    assert cache.nbytes() == layer_tensor_bytes(cache)
    # the memory really shrank: far below the same context uncompressed
    full = KVWiseCache(tiny_model, "full")
    with torch.no_grad():
        full.compress_context(random_ids(1, LENGTH))
    assert cache.nbytes() < full.nbytes() * (1 - ratio) + 2000


@pytest.mark.parametrize("policy", EVICTING + ["quest"])
def test_policy_generates_after_compression(llama, policy):
    ids = random_ids(1, LENGTH)
    cache = KVWiseCache(llama, policy, compression_ratio=0.75)
    with torch.no_grad():
        cache.compress_context(ids)
    question = random_ids(1, 5, seed=9)
    out = llama.generate(torch.cat([ids, question], 1), cache=cache, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, LENGTH + 5 + 4)
    # the question and 3 fed-back tokens were appended after compression
    per_head = round(0.25 * LENGTH)
    total = sum(int(c.sum()) for c in cache.kept_tokens().values())
    if policy != "quest":
        assert total == (per_head + 5 + 3) * 2 * 3


def test_pyramidkv_budgets_fall_with_depth(llama):
    cache = KVWiseCache(llama, "pyramidkv", compression_ratio=0.5)
    with torch.no_grad():
        cache.compress_context(random_ids(1, LENGTH))
    per_layer = [int(c[0, 0]) for c in cache.kept_tokens().values()]
    assert per_layer[0] > per_layer[1] > per_layer[2]
    assert sum(per_layer) == 3 * 30


def test_adakv_frees_memory_per_head():
    """Heads keep different numbers of tokens and the storage holds exactly those tokens."""
    from tests.conftest import TINY_MODELS

    model = TINY_MODELS["llama"]()
    cache = KVWiseCache(model, "adakv", compression_ratio=0.8)
    with torch.no_grad():
        cache.compress_context(random_ids(1, 100))
    uneven = False
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    for layer in cache.compressing_layers:
        counts = layer.kept_tokens()
        uneven |= bool(counts.min() != counts.max())
        assert layer.store.residual_keys.shape == (int(counts.sum()), head_dim)
        assert int(counts.sum()) == 20 * 2  # the layer's budget, shared by its heads
    assert uneven, "Ada-KV should move budget between heads on a random model"
    # the bytes are those of the kept entries only, not of a padded or masked cache
    entry_bytes = 2 * head_dim * 4 + 4  # key + value float32, int32 position
    assert cache.nbytes() == 3 * (40 * entry_bytes + 2 * 2 * 8)  # + two [1, 2] int64 length tensors


def test_decode_budget_holds_while_generating(llama):
    for policy in ["streaming_llm", "h2o", "tova", "scissorhands", "snapkv"]:
        cache = KVWiseCache(llama, policy, max_kv_tokens=16)
        llama.generate(random_ids(1, 30), cache=cache, max_new_tokens=12, do_sample=False)
        for counts in cache.kept_tokens().values():
            assert (counts == 16).all(), policy
        assert cache.get_seq_length() == 30 + 11


def test_streaming_llm_keeps_sinks_and_recent(llama):
    cache = KVWiseCache(llama, "streaming_llm", compression_ratio=0.5, num_sinks=4)
    with torch.no_grad():
        cache.compress_context(random_ids(1, 40))
    positions = cache.compressing_layers[0].positions.view(1, 2, 20)
    expected = list(range(4)) + list(range(24, 40))
    assert positions[0, 0].tolist() == expected


def test_quest_reads_fewer_bytes_than_it_holds(llama):
    cache = KVWiseCache(llama, "quest", compression_ratio=0.75, page_size=8)
    with torch.no_grad():
        cache.compress_context(random_ids(1, 64))
        held = cache.nbytes()
        llama(random_ids(1, 1, seed=4), cache=cache, use_cache=True)
    read = cache.bytes_read_last_step()
    assert 0 < read < held / 2
    assert all((c == 65).all() for c in cache.kept_tokens().values())
