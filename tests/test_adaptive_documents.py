"""`auto`'s per-document form: a document stays full while it is new or held in full, is
compressed once when it is asked about again and its full copy is gone, and every later request
reads that compressed copy; one tenant's documents never shape another's choices."""

from __future__ import annotations

import pytest

from kvwise.adaptive.controller import (
    DOCUMENT_CACHED,
    DOCUMENT_COMPRESSED,
    DOCUMENT_NEW,
    DOCUMENT_REUSED,
    AdaptiveConfig,
    AdaptiveController,
)
from kvwise.adaptive.document_reuse import DocumentReuse, worth_compressing
from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.sampling import SamplingParams
from tests.conftest import random_ids
from tests.test_adaptive_controller import _profile

pytestmark = pytest.mark.timeout(300)

HEAD = random_ids(1, 8, seed=40)[0].tolist()  # a shared head before every document


def _ask(core, document: list[int], seed: int, tenant: str = "default"):
    question = random_ids(1, 6, seed=seed)[0].tolist()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = HEAD + document + question
    request = core.make_request(prompt, params, tenant=tenant, compress_upto=len(HEAD) + len(document), kv_auto="auto")
    core.add(request)
    while core.has_work:
        core.step()
    assert request.error is None
    return request


def test_a_document_is_compressed_once_when_reused_and_read_compressed_after(llama):
    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=256))
    controller = AdaptiveController(_profile(), AdaptiveConfig(min_prompt_tokens=16))
    core.attach_controller(controller)
    popular, rare = random_ids(1, 40, seed=41)[0].tolist(), random_ids(1, 40, seed=42)[0].tolist()

    first = _ask(core, popular, seed=1)
    assert (first.kv_choice.mix, first.kv_choice.reason) == ("full", DOCUMENT_NEW)
    second = _ask(core, popular, seed=2)  # its full copy is in the prefix cache: a hit costs least
    assert (second.kv_choice.mix, second.kv_choice.reason) == ("full", DOCUMENT_CACHED)
    assert second.reused >= len(HEAD) + 40 - 4
    core.kv.spill_cold_prefixes(10**6)  # the full copy leaves (no tiers: dropped)

    third = _ask(core, popular, seed=3)  # asked about again, held nowhere: compressed once
    assert third.kv_choice.reason == DOCUMENT_REUSED and third.kv_choice.mix == "kvzip@0.9+kivi4"
    assert not third.compressed_hit and len(core.kv.compressed_entries()) == 1
    fourth = _ask(core, popular, seed=4)  # the same mix, so the compressed copy is found
    assert (fourth.kv_choice.mix, fourth.kv_choice.reason) == (third.kv_choice.mix, DOCUMENT_COMPRESSED)
    assert fourth.compressed_hit

    other = _ask(core, popular, seed=5, tenant="other")  # another tenant's sightings are its own
    assert (other.kv_choice.mix, other.kv_choice.reason) == ("full", DOCUMENT_NEW)
    # this tenant's one document came back 3 times: a new one is expected back, compressed at once
    fresh = _ask(core, rare, seed=6)
    assert fresh.kv_choice.reason == DOCUMENT_REUSED and not fresh.compressed_hit
    counts = controller.decisions.counts
    assert counts[("choose", DOCUMENT_NEW)] == 2 and counts[("choose", DOCUMENT_REUSED)] == 2


def test_compressing_pays_once_the_misses_it_spares_outweigh_its_pass():
    # a prefill of 3 ms per token; compressing costs 5 ms per token more: worth it from 2 misses spared
    assert not worth_compressing(0, 0.003, 0.005)
    assert not worth_compressing(1, 0.003, 0.005)
    assert worth_compressing(2, 0.003, 0.005)
    assert worth_compressing(1, None, 0.005) and not worth_compressing(0.5, None, 0.005)  # no costs: back once
    records = DocumentReuse(capacity=2)
    first = records.sight("t", [1, 2])
    assert (first.sightings, first.expected_reuse) == (1, 0.0)  # nothing known yet
    again = records.sight("t", [1, 2])
    assert (again.sightings, again.expected_reuse) == (2, 1)  # its own repeats
    assert records.sight("t", [3]).expected_reuse == 1.0  # the tenant's mean: 1 repeat per document
    assert records.sight("u", [3]).expected_reuse == 0.0  # another tenant's history is its own
    records.sight("t", [4])  # the oldest record goes past the capacity
    assert len(records) == 2 and records.sight("t", [1, 2]).sightings == 1
    with pytest.raises(ValueError, match="capacity"):
        DocumentReuse(capacity=0)
