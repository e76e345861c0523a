"""The cluster's routing, without Ray: the prefix directory's scores and load guard, the text
prefix tree stand-in, the ingress's block names against the engine's own, metrics joining."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from kvwise.cluster.ingress import join_metrics
from kvwise.cluster.prefix_directory import DEVICE, HOST, SHARED, PrefixDirectory, short_key
from kvwise.cluster.routed_request import KeySpace, PromptEncoder, RoutedRequest, RoutingKeys
from kvwise.cluster.text_prefix import TextPrefixTree
from kvwise.core.hashing import ROOT_KEY, Namespace, block_key, chain_keys
from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.server.api_keys import KeyEntry
from kvwise.server.app import RequestHandlers, ServerSettings, create_app
from tests.base_model import character_tokenizer

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_the_replica_holding_the_prefix_on_its_device_wins_at_equal_load():
    directory = PrefixDirectory(block_size=16)
    blocks = list(range(10))
    directory.report("a", {DEVICE: blocks[:8]})
    directory.report("b", {DEVICE: blocks[:2]})
    ranking = directory.rank(["a", "b"], blocks, prompt_tokens=170)
    assert [choice.replica for choice in ranking] == ["a", "b"]
    assert ranking[0].matched == {DEVICE: 8, HOST: 0, SHARED: 0}


def test_a_prefix_ends_at_its_first_missing_block_and_tiers_count_at_their_restore_cost():
    directory = PrefixDirectory(block_size=16)
    directory.report("a", {DEVICE: [0, 1], HOST: [2, 3, 4], "restore_cost": {HOST: 0.5}})
    directory.report("b", {DEVICE: [0, 1, 2, 3], "published": [5, 6]})  # 5, 6: on the shared tier
    assert directory.match("a", [0, 1, 2, 3, 4, 9, 5]) == {DEVICE: 2, HOST: 3, SHARED: 0}
    assert directory.match("b", [0, 1, 2, 3, 4, 5]) == {DEVICE: 4, HOST: 0, SHARED: 0}  # 4: nowhere
    assert directory.match("a", [5, 6, 7]) == {DEVICE: 0, HOST: 0, SHARED: 2}  # any replica reads Redis
    # a: 2 device + 3 host blocks at half price = 3.5 blocks saved; b: 4 blocks saved
    costs = {choice.replica: choice.cost for choice in directory.rank(["a", "b"], [0, 1, 2, 3, 4], 80)}
    assert costs == {"a": pytest.approx(80 - 3.5 * 16), "b": pytest.approx(80 - 4 * 16)}


def test_queued_prefill_outweighs_a_short_match():
    directory = PrefixDirectory(block_size=16)
    directory.report("a", {DEVICE: [0], "queued_prefill_tokens": 5000})
    directory.report("b", {})
    assert directory.rank(["a", "b"], [0, 1, 2], 64)[0].replica == "b"


def test_the_load_guard_sends_to_the_least_loaded_replica_when_the_best_match_is_overloaded():
    directory = PrefixDirectory(block_size=16, decode_weight=0.0, imbalance=4)
    directory.report("a", {DEVICE: list(range(100)), "waiting": 4})
    directory.report("b", {"waiting": 1})
    assert directory.rank(["a", "b"], list(range(100)), 1700)[0].replica == "a"  # 3 apart: the match wins
    directory.report("a", {DEVICE: list(range(100)), "waiting": 5})
    assert directory.rank(["a", "b"], list(range(100)), 1700)[0].replica == "b"


def test_what_the_router_sent_counts_before_any_report_and_finishing_frees_the_load():
    directory = PrefixDirectory(block_size=16)
    directory.report("a", {})
    directory.report("b", {})
    directory.routed("b", "r1", [7, 8, 9], uncached_tokens=48)
    assert directory.match("b", [7, 8, 9, 10]) == {DEVICE: 3, HOST: 0, SHARED: 0}
    assert directory.load("b") == 1 and directory.queued_tokens("b") == 48
    directory.completed("b", "r1")
    assert directory.load("b") == 0
    directory.forget("b")
    assert directory.match("b", [7]) == {DEVICE: 0, HOST: 0, SHARED: 0}


def test_a_report_older_than_the_routers_news_of_a_finished_request_no_longer_counts_its_load():
    # a sequential client: the report was taken while the request ran, then the request finished;
    # until the next report, the replica holding the prefix must not look busy with it
    directory = PrefixDirectory(block_size=4)
    blocks = list(range(30))
    directory.routed("a", "r1", blocks, uncached_tokens=128)
    directory.report("a", {DEVICE: blocks, "queued_prefill_tokens": 128, "running": 1, "reported_at": time.time()})
    directory.report("b", {"published": blocks, "reported_at": time.time()})  # b restores from Redis
    assert directory.rank(["a", "b"], blocks, 128)[0].replica == "b"  # a is busy with r1's prefill
    directory.answering("a", "r1")
    assert directory.queued_tokens("a") == 0 and directory.load("a") == 1  # decoding: still in flight
    directory.completed("a", "r1")
    directory.completed("a", "r1")  # Ray's late word of the same request changes nothing
    ranking = directory.rank(["a", "b"], blocks, 128)
    assert ranking[0].replica == "a" and ranking[0].cost == 8  # its own device holds all 30 blocks
    assert directory.load("a") == 0
    directory.report("a", {DEVICE: blocks, "running": 1, "reported_at": time.time()})  # a newer report counts
    assert directory.load("a") == 1


def test_the_text_tree_matches_by_characters_and_prefers_the_replica_holding_least():
    tree = TextPrefixTree()
    tree.insert("You are a helpful assistant. Doc A", "r1")
    tree.insert("Unrelated", "r2")
    matched, holders = tree.match("You are a helpful assistant. Doc B", ["r1", "r2"])
    assert matched == len("You are a helpful assistant. Doc ") and holders == {"r1"}
    assert tree.smallest(["r1", "r2", "r3"])[0] == "r3"
    tree.remove("r1")
    assert tree.match("You are", ["r1", "r2"]) == (0, set())


def test_joined_metrics_name_each_family_once_and_label_every_sample_by_replica():
    one = '# HELP x_total X\n# TYPE x_total counter\nx_total{tenant="a"} 1.0\ny 2\n'
    text = join_metrics([("r1", one), ("r2", one.replace("1.0", "3.0"))])
    assert text.count("# HELP x_total") == 1
    assert 'x_total{replica="r1",tenant="a"} 1.0' in text and 'x_total{replica="r2",tenant="a"} 3.0' in text
    assert 'y{replica="r2"} 2' in text


@pytest.fixture
def served(llama):
    """A single server on the tiny Llama with two tenants' keys, and the ingress's view of it."""
    tokenizer = character_tokenizer()
    core = EngineCore(llama, tokenizer, CacheConfig(block_size=4, num_blocks=512), namespace_key=b"k" * 32)
    keys = {
        "key-a": KeyEntry("alice"),
        "key-b": KeyEntry("bob", shared_prefix=True, shared_read=True, shared_write=True),
    }
    settings = ServerSettings("tiny", keys, chat_template=TEMPLATE)
    namespaces = core.kv.namespace_of
    space = KeySpace(namespaces.model_id, namespaces.kv_format, core.kv.block_size)
    encoder = PromptEncoder(tokenizer, core.vocab_size, core.max_positions)
    routing = RoutingKeys(RequestHandlers(encoder, None, settings), space, namespaces.secret)
    with TestClient(create_app(core, settings)) as client:
        yield core, client, routing


def _routed(path: str, body: dict, key: str) -> RoutedRequest:
    headers = [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")]
    return RoutedRequest("POST", path, b"", headers, json.dumps(body).encode())


@pytest.mark.parametrize("tenant_key", ["key-a", "key-b"])
def test_the_ingress_names_a_prompts_blocks_as_the_engine_caches_them(served, tenant_key):
    core, client, routing = served
    chat = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "be brief " * 4},
            {"role": "user", "content": "what is a block? " * 3},
        ],
        "max_tokens": 2,
    }
    completion = {"model": "tiny", "prompt": "the quick brown fox " * 5, "max_tokens": 2}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        routed = routing.annotate(_routed(path, body, tenant_key))
        before = {short_key(key) for key in core.kv.routing_snapshot(0).device}
        assert routed.blocks and not set(routed.blocks) & before  # not cached yet
        response = client.post(path, json=body, headers={"Authorization": f"Bearer {tenant_key}"})
        assert response.status_code == 200, response.text
        cached = {short_key(key) for key in core.kv.routing_snapshot(0).device}
        assert set(routed.blocks) <= cached
        assert routed.prompt_tokens == response.json()["usage"]["prompt_tokens"]
        assert len(routed.blocks) == (routed.prompt_tokens - 1) // 4


def test_block_names_are_salted_by_tenant_and_secret_and_never_hold_text(served):
    _, _, routing = served
    body = {"model": "tiny", "prompt": "same words for everyone " * 4, "max_tokens": 2}
    alice = routing.annotate(_routed("/v1/completions", body, "key-a")).blocks
    bob = routing.annotate(_routed("/v1/completions", body, "key-b")).blocks
    assert alice and bob and not set(alice) & set(bob)
    tokens = character_tokenizer()(body["prompt"]).input_ids
    unsalted = chain_keys(tokens[: len(alice) * 4], 4, Namespace(routing.key_space.model_id, "alice"))
    assert not {short_key(key) for key in unsalted} & set(alice)  # the secret keys every name
    directory = PrefixDirectory(block_size=4)
    directory.report("r1", {DEVICE: alice})
    directory.routed("r2", "x", bob, 0)
    state = json.dumps({"reports": {k: sorted(v.device) for k, v in directory.reports.items()}})
    assert "same words" not in state and all(isinstance(block, int) for block in alice + bob)
    assert short_key(block_key(ROOT_KEY, tokens[:4], b"")) not in alice


def test_a_request_the_server_would_refuse_is_routed_without_names(served):
    _, _, routing = served
    broken = RoutedRequest("POST", "/v1/completions", b"", [(b"authorization", b"Bearer key-a")], b"{not json")
    assert routing.annotate(broken).blocks == []
    unknown = _routed("/v1/completions", {"model": "tiny", "prompt": "x" * 40}, "no-such-key")
    assert routing.annotate(unknown).blocks == []


def test_a_prefix_cached_nowhere_goes_to_the_replica_holding_fewest_blocks():
    directory = PrefixDirectory(block_size=16)
    directory.report("a", {DEVICE: [1, 2, 3]})
    directory.report("b", {DEVICE: [4]})
    assert directory.rank(["a", "b"], [9, 10], 40)[0].replica == "b"
    directory.routed("b", "r", [11, 12, 13, 14], 64)
    directory.completed("b", "r")
    assert directory.rank(["a", "b"], [20, 21], 40)[0].replica == "a"
