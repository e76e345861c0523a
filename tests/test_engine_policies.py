"""Every registered policy in the serving engine, on head pages.

For each policy: the budget each (layer, KV head) holds is the library path's, the blocks the
evicted tokens used are really back in the pool, the kept tokens keep their original positions,
and greedy output equals the library path's `KVWiseCache` with the same policy and ratio
(`compress_context` on all but the last prompt token, then `generate`; in the engine the same
through `compress_upto`).
"""

from __future__ import annotations

import pytest
import torch

from kvwise.engine.block_table import Place
from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.kv_settings import resolve
from kvwise.engine.sampling import SamplingParams
from kvwise.hf.cache import KVWiseCache
from kvwise.policies.mix import Mix
from kvwise.policies.registry import policy_classes
from kvwise.policies.selection import head_budgets, kept_per_head
from tests.conftest import random_ids

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("kvzap_surrogate")]

EVICTING = sorted(name for name, policy in policy_classes().items() if not policy.keeps_everything)
# quest keeps everything and narrows what each decode step reads: its own test below
PROMPT, NEW_TOKENS, RATIO, BLOCK = 61, 8, 0.6, 4


def _engine(model, **config):
    settings = dict(block_size=BLOCK, num_blocks=256, token_budget=256, prefix_caching=False)
    return EngineCore(model, None, CacheConfig(**{**settings, **config}))


def _run(core, requests, after_compaction=None):
    for request in requests:
        core.add(request)
    while core.has_work:
        core.step()
        for request in requests:
            if after_compaction and request.region is not None and not request.output[1:]:
                after_compaction(request)


def _library_tokens(model, ids, policy, quant=None):
    cache = KVWiseCache(model, policy, RATIO, quant=quant)
    cache.compress_context(ids[:, :-1])
    out = model.generate(
        ids, past_key_values=cache, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
    )
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("policy", EVICTING)
def test_every_policy_holds_its_budget_frees_blocks_and_matches_the_library(llama, policy):
    ids = random_ids(1, PROMPT, seed=7)
    core = _engine(llama)
    layers, heads = core.kv.geometry.num_layers, core.kv.geometry.num_kv_heads
    request = core.make_request(
        ids[0].tolist(),
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        kv=Mix(policy, ratio=RATIO),
        compress_upto=PROMPT - 1,
    )
    seen = {}

    def check(request):
        if seen:
            return
        region = request.region
        seen["counts"] = [list(layer) for layer in region.counts]
        seen["positions"] = [positions.clone() for positions in region.positions]
        seen["pages"] = region.num_pages
        seen["used_blocks"] = core.kv.stats().used_blocks
        seen["tail_blocks"] = len(request.blocks)
        seen["bytes"] = core.kv.request_bytes(request)

    _run(core, [request], after_compaction=check)
    private = PROMPT - 1
    counts = torch.tensor(seen["counts"])  # [layers, kv_heads]
    scorer = resolve(Mix(policy, ratio=RATIO)).scorer
    per_head = kept_per_head(private, RATIO)
    if scorer.budget_scope == "global":
        assert int(counts.sum()) == per_head * layers * heads
    elif scorer.budget_scope == "layer":
        assert counts.sum(dim=1).tolist() == [per_head * heads] * layers
    else:
        budgets = [head_budgets(scorer, RATIO, [private], layer, layers)[0] for layer in range(layers)]
        assert counts.tolist() == [[budget] * heads for budget in budgets]
    # real memory: the pages hold exactly the kept tokens, rounded up to a page per head
    page_tokens = core.kv.page_tokens
    assert seen["pages"] == sum(-(-count // page_tokens) for count in counts.flatten().tolist())
    page_blocks = -(-seen["pages"] // (layers * heads * (BLOCK // page_tokens)))
    assert seen["used_blocks"] <= page_blocks + seen["tail_blocks"]
    full_blocks = -(-private // BLOCK)
    assert seen["bytes"] < full_blocks * core.kv._storage.nbytes() // core.kv.num_blocks
    for layer, positions in enumerate(seen["positions"]):  # kept tokens sit at their own positions
        for head in range(heads):
            kept = positions[head, : seen["counts"][layer][head]]
            assert kept.tolist() == sorted(set(kept.tolist())) and 0 <= int(kept.min()) and int(kept.max()) < private
    assert request.output == _library_tokens(llama, ids, policy)
    assert core.kv.stats().used_blocks == 0 and core.kv.stats().head_page_bytes == 0


@pytest.mark.parametrize("policy", ["snapkv", "adakv", "pyramidkv", "h2o", "kvzip"])
def test_a_cap_during_decoding_keeps_each_head_at_most_the_cap(llama, policy):
    ids = random_ids(1, 30, seed=3)[0].tolist()
    core = _engine(llama, token_budget=64)
    cap = 12
    request = core.make_request(
        ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), kv=Mix(policy, max_tokens=cap)
    )
    core.add(request)
    most = 0
    while core.has_work:
        core.step()
        if not request.done:
            tail = request.computed - request.kv_offset - request.reused
            most = max(most, (request.region.longest() if request.region is not None else 0) + tail)
            if request.region is not None:  # every kept token sits at its own position, once
                for counts, positions in zip(request.region.counts, request.region.positions):
                    for head, count in enumerate(counts):
                        kept = positions[head, :count].tolist()
                        assert kept == sorted(set(kept)) and 0 <= kept[0] and kept[-1] < request.computed
    assert len(request.output) == 40
    assert cap < most <= cap + BLOCK + 1  # evicted back to the cap whenever a block's worth piled up
    assert core.kv.stats().used_blocks == 0 and core.kv.stats().head_page_bytes == 0


def test_evicted_requests_beside_plain_ones_leave_the_plain_outputs_alone(llama):
    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (40, 57, 33, 45)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain_core = _engine(llama, token_budget=48)
    plain = [plain_core.make_request(p, params) for p in prompts]
    _run(plain_core, plain)
    core = _engine(llama, token_budget=48)
    settings = [None, Mix("kvzip", ratio=0.7), None, Mix("adakv", ratio=0.5)]
    mixed = [core.make_request(p, params, kv=kv) for p, kv in zip(prompts, settings)]
    _run(core, mixed)
    assert [r.output for r in mixed[::2]] == [r.output for r in plain[::2]]
    assert all(len(r.output) == 10 for r in mixed)
    assert core.kv.stats().used_blocks == 0


def test_freed_pages_and_blocks_are_zeroed(llama):
    core = _engine(llama)
    request = core.make_request(
        random_ids(1, 50, seed=5)[0].tolist(),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        kv=Mix("adakv", ratio=0.8),
    )
    _run(core, [request])
    assert core.kv.stats().used_blocks == 0
    for keys, values in zip(core.kv._storage.keys, core.kv._storage.values):
        assert not keys.any() and not values.any()


QUANTIZERS = ["kivi2", "kivi4", "int8", "fp8"]


@pytest.mark.parametrize("quant", QUANTIZERS)
@pytest.mark.parametrize("policy", EVICTING)
def test_every_policy_composes_with_every_quantizer(llama, policy, quant):
    """Evict, then quantize what is kept: the region's pages are quantized, and hold fewer bytes
    than the same tokens in the model's dtype (outputs against the library: test_mix_parity)."""
    ids = random_ids(1, 200, seed=11)[0].tolist()
    core = _engine(llama, token_budget=64)
    settings = Mix(policy, ratio=0.5, max_tokens=24 if policy in ("h2o", "snapkv") else None, quant=quant)
    request = core.make_request(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), kv=settings)
    core.add(request)
    quantized = []
    while core.has_work:
        core.step()
        region = request.region
        # while the prompt is read, a cap keeps its newest tokens (all 24) in the model's dtype, as
        # the stored form's residual window; the ratio's compaction at its end quantizes them
        if region is not None and not request.done and request.output:
            assert region.quant is not None and region.quant.name == core.kv._quantized_pages[settings.quant].name
            row_bytes = core.kv._head_pages.page_bytes // core.kv.page_tokens
            float_bytes = sum(map(sum, region.counts)) * row_bytes
            quantized.append(region.nbytes / float_bytes)
    assert len(request.output) == 12 and quantized
    # under 0.5 once the prompt is compressed: KIVI pages are one 32-token group, a head capped at
    # 24 tokens pads a third of one; then the tokens decoded stay in the model's dtype (the
    # residual window) and rows evicted from a page leave it whole, yet it holds fewer bytes
    assert quantized[0] < (0.6 if quant in ("int8", "fp8") else 0.5)
    assert max(quantized) < 1.0
    assert core.kv.stats().head_page_bytes == 0 and core.kv.stats().used_blocks == 0
    assert core.kv._quantized_pages[settings.quant].used_bytes() == 0


@pytest.mark.parametrize("policy", ["snapkv", "adakv", "pyramidkv", "kvzip"])
def test_sliding_window_models_keep_their_windows_and_match_the_library(gemma2, policy):
    """Gemma 2: sliding-window (8) and full layers alternate, with capped logits. Budgets go to the
    full layers; a sliding layer keeps its window, as transformers' own cache does."""
    ids = random_ids(1, PROMPT, seed=9)
    core = _engine(gemma2)
    request = core.make_request(
        ids[0].tolist(),
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        kv=Mix(policy, ratio=RATIO),
        compress_upto=PROMPT - 1,
    )
    counts = []
    _run(core, [request], after_compaction=lambda r: counts or counts.append([list(c) for c in r.region.counts]))
    windows = core.kv.geometry.windows
    full = [layer for layer, window in enumerate(windows) if window is None]
    for layer, window in enumerate(windows):
        if window is not None:
            assert counts[0][layer] == [window - 1] * core.kv.geometry.num_kv_heads
    per_head = kept_per_head(PROMPT - 1, RATIO)
    assert sum(sum(counts[0][layer]) for layer in full) == per_head * len(full) * core.kv.geometry.num_kv_heads
    assert request.output == _library_tokens(gemma2, ids, policy)


def test_kvzip_s_pass_in_chunks_beside_other_work_matches_the_library(llama):
    """A token budget of 16: the context and its reconstruction pass both go in chunks, mixed
    with another request's decoding; the kept tokens, and so the answer, are the library's."""
    ids = random_ids(1, PROMPT, seed=7)
    core = _engine(llama, token_budget=16)
    other = core.make_request(random_ids(1, 20, seed=2)[0].tolist(), SamplingParams(max_tokens=30, ignore_eos=True))
    request = core.make_request(
        ids[0].tolist(),
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        kv=Mix("kvzip", ratio=RATIO),
        compress_upto=PROMPT - 1,
    )
    passes = []
    core.add(other)
    core.add(request)
    while core.has_work:
        core.step()
        passes.append(request.reconstruction is not None)
    assert sum(passes) >= 3  # the pass took several steps
    assert request.output == _library_tokens(llama, ids, "kvzip")
    assert len(other.output) == 30 and core.kv.stats().used_blocks == 0


@pytest.mark.smollm
@pytest.mark.parametrize("policy", ["snapkv", "adakv", "pyramidkv", "kvzip"])
def test_on_smollm_the_engine_answers_as_the_library_does(smollm, policy):
    """The embedded SmolLM2: the same document compressed the same way gives the same greedy
    answer in the engine as with `KVWiseCache`."""
    model, tokenizer = smollm
    text = " ".join(f"Locker {n} holds a {c} umbrella." for n, c in enumerate(["red", "blue", "green"] * 8))
    ids = torch.tensor([tokenizer(text + " Which colour is the umbrella in locker 4? It is").input_ids])
    core = EngineCore(model, tokenizer, CacheConfig(num_blocks=256, token_budget=128, prefix_caching=False))
    request = core.make_request(
        ids[0].tolist(),
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        kv=Mix(policy, ratio=0.75),
        compress_upto=ids.shape[1] - 1,
    )
    _run(core, [request])
    cache = KVWiseCache(model, policy, 0.75, tokenizer=tokenizer)  # the session's model back on the cache's attention
    cache.compress_context(ids[:, :-1])
    expected = model.generate(
        ids, past_key_values=cache, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
    )
    assert request.output == expected[0, ids.shape[1] :].tolist()


def test_quest_reads_only_its_top_pages_and_matches_the_library(llama):
    """Quest evicts nothing: each decode step reads the top half of each KV head's 16-token pages
    (and the newest), and answers as the library path's Quest does."""
    ids = random_ids(1, 120, seed=13)
    core = _engine(llama)
    request = core.make_request(
        ids[0].tolist(),
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        kv=Mix("quest", ratio=0.5),
    )
    _run(core, [request])
    cache = KVWiseCache(llama, "quest", 0.5)
    expected = llama.generate(
        ids, past_key_values=cache, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
    )
    assert request.output == expected[0, ids.shape[1] :].tolist()
    assert 0 < request.kv_bytes_read < 0.65 * request.kv_bytes_held_read
    assert request.region is None and core.kv.stats().used_blocks == 0


@pytest.mark.parametrize("quant", QUANTIZERS)
def test_quest_composes_with_every_quantizer(llama, quant):
    core = _engine(llama)
    request = core.make_request(
        random_ids(1, 120, seed=14)[0].tolist(),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        kv=Mix(
            "quest", ratio=0.5, quant=f"{quant}:residual_length=16:group_size=16" if quant.startswith("kivi") else quant
        ),
    )
    quantized = False
    core.add(request)
    while core.has_work:
        core.step()
        quantized |= Place.QUANTIZED in request.blocks.places
    assert quantized and len(request.output) == 12
    assert 0 < request.kv_bytes_read < 0.65 * request.kv_bytes_held_read
    assert core.kv.stats().used_blocks == 0
