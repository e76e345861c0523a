"""Compress once, answer many: a document compressed query-agnostically in the engine is reused,
read-only, by later requests with the same tokens before their question, in the same namespace,
with the same mix; they compute only their question."""

from __future__ import annotations

import pytest
import torch

from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.kv_settings import resolve
from kvwise.engine.sampling import SamplingParams
from tests.conftest import random_ids

pytestmark = pytest.mark.timeout(300)

DOCUMENT = random_ids(1, 80, seed=21)[0].tolist()
QUESTIONS = [random_ids(1, n, seed=n)[0].tolist() for n in (7, 9, 12)]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine(model, num_blocks=256):
    return EngineCore(model, None, CacheConfig(block_size=4, num_blocks=num_blocks, token_budget=128))


def _ask(core, question, mix="kvzip@0.75", tenant="default", document=DOCUMENT):
    request = core.make_request(
        document + question, PARAMS, tenant=tenant, kv=resolve(mix), compress_upto=len(document)
    )
    core.add(request)
    while core.has_work:
        core.step()
    return request


def _first_chunk_start(core, request):
    return next(start for record in core.step_log for rid, _, start, _ in record.chunks if rid == request.request_id)


@pytest.mark.parametrize("mix", ["kvzip@0.75", "adakv@0.8+kivi4", "h2o@0.5"])
def test_later_questions_reuse_the_compressed_document_and_answer_as_if_compressed_afresh(llama, mix):
    core = _engine(llama)
    first = _ask(core, QUESTIONS[0], mix)
    later = [_ask(core, question, mix) for question in QUESTIONS[1:]]
    assert _first_chunk_start(core, first) == 0
    for request in later:
        assert _first_chunk_start(core, request) == len(DOCUMENT)  # only the question was computed
    assert core.kv.stats().compressed_hits == 2 and core.kv.stats().compressed_documents == 1
    for question, request in zip(QUESTIONS[1:], later):
        alone = _ask(_engine(llama), question, mix)  # a fresh engine compresses the same document
        assert request.output == alone.output
        assert request.compressed_kv_bytes == alone.compressed_kv_bytes
    # the cache holds the region, no request does
    assert core.kv.compressed_entries() and all(e.region.holders == 1 for e in core.kv.compressed_entries())


def test_another_tenant_mix_or_preamble_is_another_entry(llama):
    core = _engine(llama)
    _ask(core, QUESTIONS[0])
    _ask(core, QUESTIONS[1], tenant="bob")
    _ask(core, QUESTIONS[1], mix="kvzip@0.5")
    _ask(core, QUESTIONS[1], document=[5, 6, 7, 8] + DOCUMENT)  # another system prompt before it
    assert core.kv.stats().compressed_hits == 0 and core.kv.stats().compressed_documents == 4
    _ask(core, QUESTIONS[2], tenant="bob")
    assert core.kv.stats().compressed_hits == 1


def test_compressed_documents_give_way_under_memory_pressure_and_are_zeroed(llama):
    core = _engine(llama, num_blocks=48)
    documents = [random_ids(1, 80, seed=30 + i)[0].tolist() for i in range(8)]
    for document in documents:
        _ask(core, QUESTIONS[0], document=document)
    assert core.kv._compressed.evictions > 0
    while core.kv.stats().compressed_documents:
        core.kv._let_go(core.kv._compressed.evict_one()[1].region)
    core.kv.spill_cold_prefixes(core.kv.num_blocks)
    assert core.kv.stats().used_blocks == 0 and core.kv.stats().head_page_bytes == 0
    assert not core.kv._storage.all_keys.any() and not core.kv._storage.all_values.any()


def test_a_document_as_long_as_the_prompt_is_compressed_but_not_reused(llama):
    core = _engine(llama)
    _ask(core, [], document=DOCUMENT)
    again = _ask(core, [], document=DOCUMENT)
    assert _first_chunk_start(core, again) == 0 and len(again.output) == PARAMS.max_tokens


@pytest.mark.parametrize("tier_kind", ["host", "disk"])
@pytest.mark.parametrize("mix", ["kvzip@0.75", "snapkv@0.7+kivi4:group_size=4,residual_length=4", "h2o@0.6"])
def test_a_document_pushed_off_the_device_comes_back_from_a_tier_bit_for_bit(llama, mix, tier_kind, tmp_path):
    from kvwise.tiers.disk import DiskTier
    from kvwise.tiers.host import HostTier

    tier = HostTier(1 << 28) if tier_kind == "host" else DiskTier(tmp_path)
    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=48, token_budget=128), tiers=[tier])
    first = _ask(core, QUESTIONS[0], mix)
    entry = next(iter(core.kv.compressed_entries()))
    region = entry.region
    before = [part.clone() for layer in range(3) for part in region.read(core.kv._storage, layer)]
    for seed in range(8):  # other documents push it off the device, to the tier
        _ask(core, QUESTIONS[0], mix, document=random_ids(1, 80, seed=40 + seed)[0].tolist())
    assert core.kv.stats().compressed_spilled > 0 and entry not in core.kv.compressed_entries()
    again = _ask(core, QUESTIONS[0], mix)
    assert core.kv._compressed.restored >= 1 and again.compressed_hit
    assert _first_chunk_start(core, again) == len(DOCUMENT)  # only the question was computed
    assert again.output == first.output
    restored = next(e for e in core.kv.compressed_entries() if e.tokens == tuple(DOCUMENT))
    after = [part for layer in range(3) for part in restored.region.read(core.kv._storage, layer)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # quantized codes came back as they were
    assert restored.region.counts == region.counts


def test_a_tier_entry_of_an_older_format_is_a_miss(llama, monkeypatch, tmp_path):
    from kvwise.tiers import payload
    from kvwise.tiers.disk import DiskTier

    tier = DiskTier(tmp_path)
    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=48, token_budget=128), tiers=[tier])
    monkeypatch.setattr(payload, "VERSION", 1)  # written by a kvwise that knew no head regions
    _ask(core, QUESTIONS[0])
    for seed in range(8):
        _ask(core, QUESTIONS[0], document=random_ids(1, 80, seed=40 + seed)[0].tolist())
    monkeypatch.setattr(payload, "VERSION", 2)
    assert core.kv.stats().compressed_spilled > 0
    again = _ask(core, QUESTIONS[1])
    assert not again.compressed_hit and core.kv._compressed.restored == 0
    assert tier.stats.corrupt > 0  # read, refused, deleted


def test_a_region_of_the_previous_stored_form_is_a_miss(llama, monkeypatch, tmp_path):
    """Quantized regions before sinks and group-sized pages (`kvwise-head-region/1`) do not fit
    today's pages: such an entry is a miss, computed again, never misread."""
    from kvwise.engine import compressed_payload
    from kvwise.tiers.disk import DiskTier

    mix = "snapkv@0.7+kivi4:group_size=4,residual_length=4"
    core = EngineCore(
        llama, None, CacheConfig(block_size=4, num_blocks=48, token_budget=128), tiers=[DiskTier(tmp_path)]
    )
    monkeypatch.setattr(compressed_payload, "FORMAT", "kvwise-head-region/1")
    first = _ask(core, QUESTIONS[0], mix)
    for seed in range(8):
        _ask(core, QUESTIONS[0], mix, document=random_ids(1, 80, seed=40 + seed)[0].tolist())
    assert core.kv.stats().compressed_spilled > 0
    monkeypatch.setattr(compressed_payload, "FORMAT", "kvwise-head-region/2")
    again = _ask(core, QUESTIONS[0], mix)
    assert not again.compressed_hit and core.kv._compressed.restored == 0
    assert again.output == first.output  # computed again, to the same answer
