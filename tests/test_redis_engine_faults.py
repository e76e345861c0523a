"""A live engine over a Redis tier under attack and outage: every tampered entry is detected,
counted and recomputed, none served; Redis killed, restarted, frozen and thawed mid-run costs no
request its correct answer, and no engine step more than one socket timeout in tier calls."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.sampling import SamplingParams
from kvwise.tiers.redis_tier import RedisTier
from tests.conftest import TINY_MODELS
from tests.redis_servers import start_redis, start_redis_on

CONFIG = CacheConfig(block_size=4, num_blocks=40, token_budget=64, max_running=4)
NAMESPACE_KEY = b"n" * 32
KEYS = {"hmac": {"hmac_key": b"h" * 32}, "aes-gcm": {"encryption_key": b"e" * 32}}
ATTACKER_KEYS = {"hmac": {"hmac_key": b"x" * 32}, "aes-gcm": {"encryption_key": b"x" * 32}}


def prompt(seed: int, length: int = 41) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 128) for _ in range(length)]


def run(core: EngineCore, tokens: list[int]):
    request = core.make_request(tokens, SamplingParams(max_tokens=4, temperature=0))
    core.add(request)
    while core.has_work:
        core.step()
    return request


def flush_device(core: EngineCore, seed: int) -> None:
    """Unrelated prompts until every earlier prefix block is evicted from the device (to Redis)."""
    for index in range(4):
        run(core, prompt(seed * 100 + index, length=100))


def stored(tier: RedisTier) -> dict[bytes, bytes]:
    """Every entry under the tier's prefix: Redis key name -> value."""
    names = sorted(tier.client.scan_iter(match=tier.prefix.encode() + b"*"))
    return dict(zip(names, tier.client.mget(names))) if names else {}


def block_key(tier: RedisTier, name: bytes) -> bytes:
    return bytes.fromhex(name.decode().removeprefix(tier.prefix))


# ---- tampering ----------------------------------------------------------------------------------
def written_by_other_weights(url: str, kind: str) -> dict[bytes, bytes]:
    """What an engine on retrained weights, sharing the Redis and every key, writes for the same
    traffic: validly sealed values, under block keys of its own (they hold the weights fingerprint)."""
    retrained = TINY_MODELS["llama"]()
    with torch.no_grad():
        retrained.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    tier = RedisTier(url, **KEYS[kind])
    core = EngineCore(retrained, None, CONFIG, tiers=[tier], namespace_key=NAMESPACE_KEY)
    run(core, prompt(4))
    flush_device(core, seed=5)
    return stored(tier)


def plant(tampering: str, kind: str, url: str, tier: RedisTier, entries: dict[bytes, bytes]) -> None:
    """Replace the engine's entries with what someone who can write the Redis, but holds none of
    its keys, can make of them."""
    names = list(entries)
    tier.client.flushdb()
    if tampering == "replayed":  # another model's valid entries, under this one's names
        others = written_by_other_weights(url, kind)
        assert others and not set(others) & set(names)  # its own names are ones this engine never asks for
        entries = dict(zip(names, (list(others.values()) * len(names))[: len(names)]))
    elif tampering == "corrupted":
        entries = {name: value[:-40] + bytes([value[-40] ^ 0x5A]) + value[-39:] for name, value in entries.items()}
    elif tampering == "truncated":
        entries = {name: value[: len(value) // 3] for name, value in entries.items()}
    elif tampering == "renamed":  # every value moved under the next entry's name
        entries = {name: entries[names[(index + 1) % len(names)]] for index, name in enumerate(names)}
    elif tampering == "forged":  # well-formed blocks of zeros of the engine's geometry, the attacker's key
        forger = RedisTier(url, **ATTACKER_KEYS[kind])
        for name in names:
            assert forger.put(block_key(tier, name), torch.zeros(3, 2, 4, 2, 16))
        return
    tier.client.mset(entries)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", sorted(KEYS))
@pytest.mark.parametrize("tampering", ["corrupted", "truncated", "renamed", "replayed", "forged"])
def test_every_tampered_redis_entry_is_detected_counted_and_recomputed(llama, redis_server, kind, tampering):
    tier = RedisTier(redis_server.url, **KEYS[kind])
    tier.client.flushdb()  # the server is shared by the module's tests
    core = EngineCore(llama, None, CONFIG, tiers=[tier], namespace_key=NAMESPACE_KEY)
    first = run(core, prompt(4))
    flush_device(core, seed=5)
    entries = stored(tier)
    assert len(entries) >= 10
    plant(tampering, kind, redis_server.url, tier, entries)
    tampered = {name: value for name, value in stored(tier).items() if name in entries}
    assert len(tampered) == len(entries) and not set(tampered.items()) & set(entries.items())

    # 100%: the engine's keys find every tampered entry corrupt (and delete it)
    probe = RedisTier(redis_server.url, **KEYS[kind])
    for name in tampered:
        assert probe.get(block_key(tier, name)) is None
    assert probe.stats.corrupt == len(tampered) and probe.stats.hits == 0 and probe.stats.errors == 0

    tier.client.mset(tampered)  # back, for the live engine
    corrupt, hits, recomputed = tier.stats.corrupt, tier.stats.hits, core.kv.prefix_stats.recomputed_blocks
    again = run(core, prompt(4))
    assert again.output == first.output and again.reused == 0  # recomputed, nothing tampered served
    assert tier.stats.hits == hits and tier.stats.corrupt > corrupt
    assert core.kv.prefix_stats.recomputed_blocks > recomputed


# ---- outage -------------------------------------------------------------------------------------
TIMEOUT_SECONDS = 0.5  # the tier's default socket timeout
RETRY_SECONDS = 2.0  # well above a step, so a step meets at most one timeout


def traffic() -> list[list[int]]:
    """Five rounds of: a prompt, two unrelated ones that push it out of the device pool (to
    Redis), and the prompt again (served from Redis when Redis is up)."""
    requests = []
    for round_index in range(5):
        repeated = prompt(1000 + round_index)
        requests += [repeated, prompt(2000 + 2 * round_index, 100), prompt(2001 + 2 * round_index, 100), repeated]
    return requests


def serve(core: EngineCore, requests: list[list[int]], events: dict) -> tuple[list, list[int]]:
    """Each request to completion; `events[index]` runs after the first step of request `index`,
    so Redis changes state in the middle of a request. Returns the outputs and, per request, the
    tokens restored from Redis."""
    outputs, redis_tokens = [], []
    for index, tokens in enumerate(requests):
        before = core.kv.prefix_stats.hits_tokens["redis"]
        request = core.make_request(tokens, SamplingParams(max_tokens=4, temperature=0))
        core.add(request)
        core.step()
        if index in events:
            events[index]()
        while core.has_work:
            core.step()
        outputs.append(request.output)
        redis_tokens.append(core.kv.prefix_stats.hits_tokens["redis"] - before)
    return outputs, redis_tokens


@pytest.mark.timeout(300)
def test_redis_killed_restarted_frozen_and_thawed_mid_run(llama, tmp_path):
    requests = traffic()
    reference, _ = serve(EngineCore(llama, None, CONFIG, namespace_key=NAMESPACE_KEY), requests, {})
    servers = [start_redis(tmp_path / "redis")]
    port = servers[0].port
    tier = RedisTier(servers[0].url, **KEYS["aes-gcm"], retry_seconds=RETRY_SECONDS)
    core = EngineCore(llama, None, CONFIG, tiers=[tier], namespace_key=NAMESPACE_KEY)
    counts = {}

    def kill() -> None:
        servers[-1].process.kill()  # SIGKILL: no goodbye on the sockets
        servers[-1].process.wait()

    def restart() -> None:
        counts["errors while down"] = tier.stats.errors
        servers.append(start_redis_on(tmp_path / "redis", port))
        time.sleep(RETRY_SECONDS)  # the fail-fast window of the last failure closes

    def freeze() -> None:  # a hung Redis: connections open, no answers, every call meets its timeout
        counts["errors before freezing"] = tier.stats.errors
        os.kill(servers[-1].process.pid, signal.SIGSTOP)

    def thaw() -> None:
        os.kill(servers[-1].process.pid, signal.SIGCONT)
        counts["errors while frozen"] = tier.stats.errors - counts["errors before freezing"]
        time.sleep(RETRY_SECONDS)

    try:
        outputs, redis_tokens = serve(core, requests, {4: kill, 8: restart, 12: freeze, 15: thaw})
    finally:
        os.kill(servers[-1].process.pid, signal.SIGCONT)
        for server in servers:
            server.stop()
    assert outputs == reference  # every request answered as without any tier
    # Redis served the repeated prompt while up, before the kill and after each recovery; nothing while down
    assert redis_tokens[3::4] == [40, 0, 40, 0, 40]
    assert counts["errors while down"] > 0 and counts["errors while frozen"] > 0
    tier_seconds = [record.tier_seconds for record in core.step_log]
    # a step meets at most one timeout (fail fast after it): a second one would take the step to
    # 2 x the timeout, so anything under that is one timeout plus scheduling noise, however loaded
    # the machine (without the timeout, a frozen Redis holds the step until the thaw: seconds)
    assert max(tier_seconds) < 2 * TIMEOUT_SECONDS, max(tier_seconds)
    assert max(tier_seconds) >= 0.8 * TIMEOUT_SECONDS  # the frozen Redis was met: the bound was tested
    assert sum(tier_seconds) == pytest.approx(core.kv.prefix_stats.seconds_in_tiers)  # every tier call in a step
