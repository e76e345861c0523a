"""Computed prefix blocks published to Redis at once, so another server on the same Redis reuses
them before the first one evicts anything; `redis+cluster://` URLs; a cluster down at startup."""

from __future__ import annotations

import time

import pytest
import torch

from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.sampling import SamplingParams
from kvwise.tiers.publisher import SharedPublisher
from kvwise.tiers.redis_tier import RedisTier
from tests.redis_launcher import free_port
from tests.redis_servers import start_cluster

HMAC = b"h" * 32
SECRET = b"s" * 32


def _engine(model, url: str, publish: bool) -> EngineCore:
    config = CacheConfig(block_size=4, num_blocks=256, publish_prefixes=publish)
    return EngineCore(model, None, config, [RedisTier(url, hmac_key=HMAC)], namespace_key=SECRET)


def _run(core: EngineCore, prompt: list[int]) -> list[int]:
    request = core.make_request(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    core.add(request)
    while core.has_work:
        core.step()
    return request.output


@pytest.mark.parametrize("publish", [True, False])
def test_a_prefix_computed_on_one_server_is_a_redis_hit_on_another(llama, redis_server, publish):
    url = redis_server.url
    first, second = _engine(llama, url, publish), _engine(llama, url, publish)
    prompt = list(range(5 + publish, 5 + publish + 41))  # 10 full blocks before the last token; one per case
    expected = _run(first, prompt)
    if publish:
        assert first.kv._tiers.publisher.flush()
    assert _run(second, prompt) == expected  # the same answer either way
    restored = second.kv.stats().tiers[0].hits_tokens
    if publish:  # the first server evicted nothing: the blocks came from publishing
        assert first.kv.stats().prefix_evictions == 0
        assert restored == 40 and first.kv.stats().tiers[0].published_blocks == 10
    else:
        assert restored == 0


def test_publishing_writes_in_batches_off_the_caller_and_drops_when_full(redis_server):
    tier = RedisTier(redis_server.url, hmac_key=HMAC)
    publisher = SharedPublisher([tier], max_queue_bytes=10 * 4 * 64)
    blocks = [(bytes([index]) * 32, torch.full((2, 2, 4, 4), float(index))) for index in range(12)]
    accepted = [publisher.offer(key, block) for key, block in blocks]
    assert publisher.flush()
    assert accepted.count(True) + publisher.dropped == 12 and publisher.published == accepted.count(True)
    for (key, block), taken in zip(blocks, accepted):
        if taken:
            assert torch.equal(tier.get(key), block)
    assert publisher.published_recently(blocks[0][0])
    publisher.close()


def test_put_many_counts_what_redis_took_and_refuses_while_down(tmp_path):
    tier = RedisTier(f"redis://127.0.0.1:{free_port()}/0", hmac_key=HMAC, timeout_seconds=0.2, retry_seconds=60)
    assert tier.put_many([(b"k" * 32, torch.zeros(1, 2, 4, 2, 2))]) == 0
    assert tier.stats.refused_puts == 1 and tier.stats.errors >= 1 and not tier.available


def test_a_cluster_url_scheme_reaches_a_redis_cluster_and_one_down_at_startup_is_joined_later(tmp_path, caplog):
    nodes = start_cluster(tmp_path / "cluster", nodes=3)
    url = f"redis+cluster://127.0.0.1:{nodes[0].port}"
    block = torch.arange(2 * 2 * 4 * 2 * 2, dtype=torch.float32).reshape(2, 2, 4, 2, 2)
    keys = [bytes([index]) * 32 for index in range(8)]  # spread over the three masters' slots
    try:
        tier = RedisTier(url, hmac_key=HMAC)
        assert tier.cluster and tier.available
        assert tier.put_many([(key, block) for key in keys]) == 8
        assert all(torch.equal(tier.get(key), block) for key in keys)
        for node in nodes:
            node.kill()
        # nothing answers at startup: the server is built without the tier, misses, and joins it later
        with caplog.at_level("WARNING", logger="kvwise.tiers"):
            late = RedisTier(url, hmac_key=HMAC, timeout_seconds=0.2, retry_seconds=0.2)
        assert "serving without it" in caplog.text  # one warning at startup
        assert late.client is None and not late.available
        assert late.get(keys[0]) is None and late.put(keys[0], block) is False
        for node in nodes:
            node.restart()  # same ports and folders: the cluster forms again from its nodes.conf
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not late.put(b"y" * 32, block):
            time.sleep(0.2)
        assert late.available and torch.equal(late.get(b"y" * 32), block)
        assert "reachable again" in caplog.text
    finally:
        for node in nodes:
            node.stop()
