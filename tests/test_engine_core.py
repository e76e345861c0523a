"""EngineCore with a real (tiny) model: no leak after 200 requests, streaming text, tenants."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvwise.engine.block_table import Place
from kvwise.engine.config import CacheConfig
from kvwise.engine.core import ContextLengthError, EngineCore
from kvwise.engine.detokenizer import IncrementalText
from kvwise.engine.sampling import SamplingParams
from kvwise.policies.mix import Mix


def assert_only_prefix_cache_holds_blocks(core: EngineCore) -> None:
    """Every block is free or held once, by the prefix tree alone, and nothing is locked."""
    held = {node.block for node in core.kv._tree.nodes()}
    for block, count in enumerate(core.kv._pool.ref_counts):
        assert count == (1 if block in held else 0), (block, count)
        assert core.kv._pool.is_free(block) == (block not in held)
    assert all(node.locks == 0 for node in core.kv._tree.nodes())
    assert not core.scheduler.running and not core.scheduler.waiting


def test_no_leak_after_200_requests_with_cancellations(llama):
    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=96, token_budget=48, max_running=8))
    rng = random.Random(3)
    shared = [rng.randrange(3, 128) for _ in range(12)]
    requests, cancelled = [], 0
    for index in range(200):
        prompt = (shared if index % 3 == 0 else []) + [rng.randrange(3, 128) for _ in range(rng.randint(1, 20))]
        request = core.make_request(prompt, SamplingParams(max_tokens=rng.randint(1, 6), temperature=0))
        core.add(request)
        requests.append(request)
        core.step()
        if index % 5 == 0:  # cancel someone: waiting, mid-prefill or mid-decode
            victim = rng.choice([r for r in requests if not r.done] or [request])
            if not victim.done:
                core.abort(victim)
                cancelled += 1
    while core.has_work:
        core.step()
    assert cancelled >= 20 and all(request.done for request in requests)
    assert sum(request.reused for request in requests) > 0  # the shared prefix was reused along the way
    assert_only_prefix_cache_holds_blocks(core)


def test_context_and_pool_limits_are_clear_errors(llama):
    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=8))
    with pytest.raises(ContextLengthError, match="maximum context is 512"):
        core.make_request([5] * 500, SamplingParams(max_tokens=20))
    with pytest.raises(ContextLengthError, match="KV pool holds 32 tokens"):
        core.make_request([5] * 30, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="at least one token"):
        core.encode([])


def test_only_the_marked_segment_uses_the_shared_namespace(llama):
    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=64))
    system, rest = list(range(10, 22)), list(range(40, 48))  # 3 shared blocks, 2 private ones
    first = core.make_request(system + rest, SamplingParams(max_tokens=1), tenant="alice")
    first.shared_prefix_tokens = len(system)
    core.add(first)
    while core.has_work:
        core.step()
    assert {node.tenant for node in core.kv._tree.nodes()} == {"alice"}  # charged to the writer's quota
    private = core.make_request(system + rest, SamplingParams(max_tokens=1), tenant="bob")
    opted_in = core.make_request(system + rest, SamplingParams(max_tokens=1), tenant="bob")
    opted_in.shared_prefix_tokens = len(system)
    for request in (private, opted_in):
        core.add(request)
        while core.has_work:
            core.step()
    assert private.reused == 0 and opted_in.reused == 12  # the segment, never alice's private rest


def test_a_read_only_key_never_publishes_to_the_shared_namespace(llama):
    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=64))
    prompt = list(range(10, 30))
    reader = core.make_request(prompt, SamplingParams(max_tokens=1), tenant="dave")
    reader.shared_prefix_tokens, reader.may_publish_shared = 12, False
    core.add(reader)
    while core.has_work:
        core.step()
    later = core.make_request(prompt, SamplingParams(max_tokens=1), tenant="erin")
    later.shared_prefix_tokens = 12
    core.add(later)
    while core.has_work:
        core.step()
    assert later.reused == 0


def test_block_keys_differ_between_servers_with_different_secrets(llama):
    keys = []
    for secret in (b"a" * 32, b"b" * 32):
        core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=64), namespace_key=secret)
        request = core.make_request(list(range(10, 30)), SamplingParams(max_tokens=1), tenant="alice")
        core.add(request)
        while core.has_work:
            core.step()
        keys.append({node.key for node in core.kv._tree.nodes()})
    assert keys[0] and not keys[0] & keys[1]


class _CharTokenizer:
    """One character per token; id 0 is EOS."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != 0)


def test_incremental_text_holds_back_partial_stops():
    text = IncrementalText(_CharTokenizer(), stop=["END"], eos=0)
    sent = [text.add(ord(c), final=False) for c in "abcE"]
    assert "".join(sent) == "abc"  # "E" might start "END"
    assert text.add(ord("x"), final=False) == "Ex"
    assert text.add(ord("E"), final=False) == "" and text.add(ord("N"), final=False) == ""
    assert text.add(ord("D"), final=True) == ""  # the stop string is never sent
    plain = IncrementalText(_CharTokenizer(), eos=0)
    assert plain.add(ord("h"), False) + plain.add(ord("i"), False) + plain.add(0, True) == "hi"


def _run(core, requests, until=None):
    for request in requests:
        core.add(request)
    while core.has_work and not (until and until()):
        core.step()


def test_a_per_request_policy_changes_only_that_request(llama):
    from tests.conftest import random_ids

    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (40, 57, 33)]
    params = SamplingParams(temperature=0, max_tokens=12)

    def engine():
        return EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=128, token_budget=32))

    plain_core = engine()
    plain = [plain_core.make_request(p, params) for p in prompts]
    _run(plain_core, plain)
    core = engine()
    mixed = [
        core.make_request(p, params, kv=Mix("snapkv", ratio=0.5) if i == 1 else None) for i, p in enumerate(prompts)
    ]
    squeezed = mixed[1]
    _run(core, mixed, until=lambda: squeezed.computed >= len(squeezed.prompt))
    kept = 28  # round(57 * 0.5): ties go to the even count (policies.selection)
    # evicted right after its prefill: each head keeps its 28 tokens in head pages...
    page_tokens = core.kv.page_tokens
    assert squeezed.region.counts == [[kept] * 2] * 3 and squeezed.region.num_pages == 3 * 2 * math.ceil(
        kept / page_tokens
    )
    assert len(squeezed.blocks) == 0  # ...and the prompt's blocks are freed
    _run(core, [])
    assert [r.output for r in mixed[::2]] == [r.output for r in plain[::2]]  # the others are untouched
    assert len(squeezed.output) == 12
    assert_only_prefix_cache_holds_blocks(core)


def test_shared_prefix_blocks_stay_intact_and_max_kv_tokens_caps_decoding(llama):
    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=128, token_budget=64))
    prefix = list(range(3, 27))  # 6 blocks
    first = core.make_request(prefix + [30, 31, 32], SamplingParams(max_tokens=1))
    _run(core, [first])
    cached = {node.block: core.kv._storage.keys[0][node.block].clone() for node in core.kv._tree.nodes()}
    capped = core.make_request(
        prefix + list(range(40, 70)),
        SamplingParams(max_tokens=40, temperature=0),
        kv=Mix("streaming_llm", ratio=0.5, max_tokens=8),
    )
    core.add(capped)
    most_private = 0
    while core.has_work:
        core.step()
        if not capped.done:
            region = capped.region.longest() if capped.region is not None else 0
            most_private = max(most_private, region + capped.computed - capped.kv_offset - capped.reused)
    assert capped.reused == 24 and len(capped.output) == 40
    assert most_private <= 8 + 4 + 1  # evicted back to 8 whenever a block's worth piled up
    for block, keys in cached.items():  # the shared prefix was read, never rewritten
        assert torch.equal(core.kv._storage.keys[0][block], keys)
    assert_only_prefix_cache_holds_blocks(core)


def test_kv_settings_errors():
    with pytest.raises(ValueError, match="unknown policy"):
        Mix("nope", ratio=0.5)
    with pytest.raises(ValueError, match=r"ratio must be in \[0, 1\)"):
        Mix("snapkv", ratio=1.0)
    with pytest.raises(ValueError, match="max_kv_tokens must be a positive integer"):
        Mix("h2o", max_tokens=0)
    with pytest.raises(ValueError, match="unknown quantizer|quant"):
        Mix("kvzip", ratio=0.5, quant="kivi3")


@pytest.mark.parametrize("swap_space_bytes", [0, 1 << 24])
def test_preemption_by_recompute_or_host_swap_keeps_outputs(llama, swap_space_bytes):
    from tests.conftest import random_ids

    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (9, 14, 11, 7)]
    params = SamplingParams(temperature=0, max_tokens=20)
    roomy = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=64, swap_space_bytes=0))
    expected = [roomy.make_request(p, params) for p in prompts]
    _run(roomy, expected)
    # 16 blocks hold 64 tokens; four requests need up to 34 each: the newest are preempted
    tight = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=16, swap_space_bytes=swap_space_bytes))
    outputs = [tight.make_request(p, params) for p in prompts]
    streamed = {id(r): [] for r in outputs}
    for request in outputs:
        tight.add(request)
    while tight.has_work:
        for event in tight.step():
            streamed[id(event.request)].append(event.token)
    assert tight.scheduler.preemptions > 0
    assert [r.output for r in outputs] == [r.output for r in expected]
    assert [streamed[id(r)] for r in outputs] == [r.output for r in expected]  # no token sent twice
    if swap_space_bytes:
        swap = tight.kv._swap
        assert swap.swapped_out_blocks > 0 and swap.swapped_in_blocks == swap.swapped_out_blocks
        assert tight.kv.recomputed_blocks == 0 and tight.kv.stats().swap_used_bytes == 0
    else:
        assert tight.kv.recomputed_blocks > 0
    assert_only_prefix_cache_holds_blocks(tight)


def test_a_per_request_quantizer_stores_private_blocks_quantized(llama):
    from tests.conftest import random_ids

    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (61, 45)]
    params = SamplingParams(temperature=0, max_tokens=10)
    plain_core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=128))
    plain = [plain_core.make_request(p, params) for p in prompts]
    _run(plain_core, plain)
    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=128))
    kv = Mix(quant="kivi4:residual_length=8:group_size=4")  # 2 residual blocks of 4 tokens
    quantized, other = core.make_request(prompts[0], params, kv=kv), core.make_request(prompts[1], params)
    for request in (quantized, other):
        core.add(request)
    device_blocks = []
    while core.has_work:
        core.step()
        if not quantized.done:
            device_blocks.append(quantized.blocks.count(Place.DEVICE))
    pool = core.kv._quant_pools[kv.quant]
    assert pool.quantized_blocks >= 10  # blocks 1 .. 16 - 2 residual, and more while decoding
    assert min(device_blocks) <= 1 + 2 + 1  # sink block + residual window (+ the open block)
    assert 0 < pool.mean_error("keys") < 0.2 and 0 < pool.mean_error("values") < 0.2
    assert pool.block_bytes < core.kv._storage.nbytes() // 128 / 3  # 4-bit codes: real bytes saved
    assert other.output == plain[1].output  # the other request is untouched
    assert quantized.output[0] == plain[0].output[0]  # sampled before anything was quantized
    assert pool.pool.stats().used == 0  # quantized blocks went back too
    assert_only_prefix_cache_holds_blocks(core)


def test_prompts_that_only_fit_one_at_a_time_still_finish(llama):
    """Two 46-token prompts that fit a 64-token pool only one at a time, in 16-token chunks."""
    from tests.conftest import random_ids

    prompts = [random_ids(1, 46, seed=seed)[0].tolist() for seed in (1, 2)]  # 13 blocks each: no whole-run reservation
    params = SamplingParams(temperature=0, max_tokens=4)
    roomy = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=64))
    expected = [roomy.make_request(p, params) for p in prompts]
    _run(roomy, expected)
    tight = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=16, token_budget=16, prefix_caching=False))
    outputs = [tight.make_request(p, params) for p in prompts]
    _run(tight, outputs)
    assert [r.output for r in outputs] == [r.output for r in expected]
    assert tight.kv.stats().used_blocks == 0


def test_token_ids_outside_the_vocabulary_are_refused(llama):
    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=16))
    with pytest.raises(ValueError, match="outside the model's vocabulary of 128"):
        core.encode([5, 128])
    with pytest.raises(ValueError, match="token id -1"):
        core.encode([-1])
