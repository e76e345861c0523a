"""Key rotation without a restart: every key accepts a list, the first writes, all read.

The namespace key (block identities), the disk tier's MAC and encryption keys, and on a live
server all of them at once through SIGHUP."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
import torch

from kvwise.engine.core import EngineCore
from kvwise.server.key_files import disk_mac_key
from kvwise.tiers.disk import DiskTier
from tests.base_model import save_base_model
from tests.live_server import LiveServer
from tests.test_engine_tiers import CONFIG, flush_device, prompt, run

OLD, NEW = b"o" * 32, b"N" * 32
TIER_HITS = "kvwise_prefix_cache_tier_hits_tokens_total"
BLOCK = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)


def test_disk_entries_verify_under_any_listed_key_and_fail_once_it_is_dropped(tmp_path):
    tier = DiskTier(tmp_path, mac_key=OLD, encryption_key=b"e" * 32)
    assert tier.put(b"k" * 32, BLOCK)
    tier.set_keys([NEW, OLD], [b"E" * 32, b"e" * 32])
    assert torch.equal(tier.get(b"k" * 32), BLOCK)  # written under the old keys, still read
    assert tier.put(b"j" * 32, BLOCK)
    tier.set_keys([NEW], [b"E" * 32])
    assert torch.equal(tier.get(b"j" * 32), BLOCK)  # written under the new keys
    assert tier.get(b"k" * 32) is None and tier.stats.corrupt == 1  # the old key is gone: a miss


def test_a_mac_only_rotation_keeps_old_entries_until_the_old_key_is_dropped(tmp_path):
    tier = DiskTier(tmp_path, mac_key=OLD)
    tier.put(b"k" * 32, BLOCK)
    tier.set_keys([NEW, OLD])
    assert tier.get(b"k" * 32) is not None and tier.mac_key == NEW
    tier.set_keys([NEW])
    assert tier.get(b"k" * 32) is None and tier.stats.corrupt == 1


def test_a_namespace_rotation_keeps_spilled_prefixes_until_the_old_key_is_dropped(llama, tmp_path):
    disk = DiskTier(tmp_path, mac_key=disk_mac_key(OLD))
    core = EngineCore(llama, None, CONFIG, tiers=[disk], namespace_key=OLD)
    first = run(core, prompt(4))
    run(core, prompt(10))  # cached under the old key only, never read during the rotation
    flush_device(core, seed=5)
    core.set_namespace_keys([NEW, OLD])
    disk.set_keys([disk_mac_key(NEW), disk_mac_key(OLD)])
    again = run(core, prompt(4))
    assert again.output == first.output and again.reused == 40  # found under the retired key
    assert core.kv.prefix_stats.hits_tokens["disk"] == 40
    flush_device(core, seed=7)
    core.set_namespace_keys([NEW])
    disk.set_keys([disk_mac_key(NEW)])
    assert run(core, prompt(4)).reused == 40  # it came back under the new key, and spilled so again
    assert run(core, prompt(10)).reused == 0  # under the dropped key only: never found again


def test_block_keys_change_for_new_requests_only(llama):
    core = EngineCore(llama, None, CONFIG, namespace_key=OLD)
    request = core.make_request(prompt(9), _params())
    core.add(request)
    core.step()  # admitted and prefilling under the old key
    core.set_namespace_keys([NEW])
    while core.has_work:
        core.step()
    assert request.namespace.secret == OLD  # it inserted its blocks under the key it matched with
    assert run(core, prompt(9)).reused == 0  # new requests use the new key: the old entries are not theirs


def _params():
    from kvwise.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=4, temperature=0)


def _cached_tokens(server, prompt_text: str, key: str) -> tuple[str, float]:
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "model", "prompt": prompt_text, "max_tokens": 4, "temperature": 0}
    before = server.value(TIER_HITS, tier="disk")
    answer = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=60)
    answer.raise_for_status()
    return answer.json()["choices"][0]["text"], server.value(TIER_HITS, tier="disk") - before


@pytest.mark.timeout(300)
def test_sighup_rotates_the_namespace_and_disk_keys_of_a_live_server(tmp_path):
    model = save_base_model(tmp_path / "model", max_positions=512)
    namespace_file, disk_file, keys = tmp_path / "namespace.key", tmp_path / "disk.key", tmp_path / "keys.txt"
    namespace_file.write_text(OLD.hex() + "\n")
    disk_file.write_text((b"e" * 32).hex() + "\n")
    keys.write_text("sk-admin ops admin\n")
    server = LiveServer(
        "--model", str(model), "--device", "cpu", "--api-keys", str(keys), "--num-blocks", "48", "--block-size", "4",
        "--namespace-key-file", str(namespace_file), "--disk-cache", str(tmp_path / "disk"),
        "--disk-key-file", str(disk_file), metrics_key="sk-admin",
    )  # fmt: skip
    try:
        text = "the quick brown fox jumps over the lazy dog " * 2
        first, _ = _cached_tokens(server, text, "sk-admin")
        for index in range(6):  # unrelated prompts push the first one's blocks out to disk
            _cached_tokens(server, f"{index} flood {index} " * 10, "sk-admin")
        namespace_file.write_text(NEW.hex() + "\n" + OLD.hex() + "\n")
        disk_file.write_text((b"E" * 32).hex() + "\n" + (b"e" * 32).hex() + "\n")
        server.process.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        again, disk_hits = _cached_tokens(server, text, "sk-admin")
        assert again == first and disk_hits > 0  # the old entries still verify and decrypt
        disk_names = {path.name for path in (tmp_path / "disk").glob("*/*.kvb")}
        namespace_file.write_text(NEW.hex() + "\n")  # the old key retired for good
        disk_file.write_text((b"E" * 32).hex() + "\n")
        server.process.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        for index in range(6, 12):
            _cached_tokens(server, f"{index} flood {index} " * 10, "sk-admin")
        later = {path.name for path in (tmp_path / "disk").glob("*/*.kvb")}
        assert later - disk_names  # new entries are written (under the new keys)
    finally:
        assert server.stop() == 0
