"""KVzip's chunked reconstruction: the context re-read in passes of `pass_chunk` tokens."""

from __future__ import annotations

import pytest
import torch

from kvwise.engine.kv_settings import resolve
from kvwise.hf.cache import KVWiseCache
from kvwise.policies.kvzip import KVzipPolicy
from kvwise.policies.mix import Mix
from tests.conftest import random_ids

pytestmark = pytest.mark.timeout(120)


def test_chunks_cover_the_context_once_each_after_the_prompt():
    policy = KVzipPolicy(pass_chunk=4)
    ids = torch.arange(10, 20)[None]
    mask = torch.ones_like(ids)
    passes = policy.context_passes(ids, mask, None)  # no tokenizer: no prompt, nothing skipped
    assert [p[0][0].tolist() for p in passes] == [list(range(10, 14)), list(range(14, 18)), [18, 19]]
    assert [p[1].shape[1] for p in passes] == [14, 14, 12]  # the whole context, then the chunk
    assert len(KVzipPolicy().context_passes(ids, None, None)) == 1
    with pytest.raises(ValueError, match="pass_chunk"):
        KVzipPolicy(pass_chunk=-1)


def test_chunked_passes_score_the_whole_context_and_keep_the_budget(llama):
    ids = random_ids(1, 60, seed=2)
    kept = {}
    for chunk in (0, 16, 60):
        policy = KVzipPolicy(pass_chunk=chunk)
        cache = KVWiseCache(llama, policy=policy, compression_ratio=0.5)
        cache.compress_context(ids)
        kept[chunk] = [layer.store.lengths.clone() for layer in cache.layers]
        assert cache.get_seq_length() == 60  # no token of any pass stays
    total = sum(int(lengths.sum()) for lengths in kept[16])
    assert total == sum(int(lengths.sum()) for lengths in kept[0])  # the same global budget
    # one chunk as long as the context is the single pass
    assert all(torch.equal(a, b) for a, b in zip(kept[60], kept[0]))
    # chunks see less of the re-read text: a different, still valid, selection
    assert any(not torch.equal(a, b) for a, b in zip(kept[16], kept[0]))


def test_the_engine_refuses_chunked_reconstruction_by_name():
    with pytest.raises(ValueError, match="pass_chunk"):
        resolve(Mix("kvzip", ratio=0.5, options={"pass_chunk": 512}))
