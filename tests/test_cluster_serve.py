"""`kvwise serve --replicas 2` on a real local Ray (one instance for the module: 2 CPUs, a small
object store, no dashboard) and a real Redis Cluster of 3 masters and 3 replicas, exercised with
the official `openai` client; then faults: a Redis master killed mid-run, a replica killed
mid-run. The model is a tiny random Llama with a character tokenizer; answers are checked
against what one engine without any tier answers."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import openai
import pytest

from kvwise.cli import build_parser
from tests.redis_launcher import free_port, masters
from tests.redis_servers import start_cluster
from tests.tiny_chars_model import greedy_texts, prompt_ids, save_tiny_llama

pytestmark = pytest.mark.timeout(240)
ray = pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is part of the test install")

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
KEYS = "key-alice alice admin\nkey-bob bob\n"
ALICE, BOB = "key-alice", "key-bob"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), max_positions=4096)


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    nodes = start_cluster(tmp_path_factory.mktemp("redis-cluster"), nodes=6, replicas=1)
    yield nodes
    for node in nodes:
        node.stop()


@pytest.fixture(scope="module")
def ray_instance():
    ray.init(num_cpus=2, object_store_memory=100 << 20, include_dashboard=False, configure_logging=False)
    yield
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def serve_args(model_dir, tmp_path, *extra: str):
    (tmp_path / "keys").write_text(KEYS)
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    (tmp_path / "hmac").write_text("ab" * 32)
    (tmp_path / "ns").write_text("cd" * 32)
    flags = ["serve", "--model", str(model_dir), "--device", "cpu", "--num-blocks", "512", "--block-size", "4"]
    flags += ["--api-keys", str(tmp_path / "keys"), "--chat-template", str(tmp_path / "template.jinja")]
    flags += ["--redis-hmac-key-file", str(tmp_path / "hmac"), "--namespace-key-file", str(tmp_path / "ns")]
    flags += [
        "--served-model-name",
        "tiny",
        "--log-stats-interval",
        "0",
        "--swap-space-gb",
        "0.1",
        "--log-level",
        "warning",
        *extra,
    ]
    return build_parser().parse_args(flags)


@pytest.fixture(scope="module")
def cluster(ray_instance, redis_cluster, model_dir, tmp_path_factory):
    import uvicorn

    from kvwise.cluster.launch import deploy

    folder = tmp_path_factory.mktemp("cluster")
    args = serve_args(model_dir, folder, "--redis-url", f"redis+cluster://127.0.0.1:{redis_cluster[0].port}")
    args.replicas = 2
    deployed = deploy(args, 2, stats_period=0.3)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(deployed.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", deployed, args
    server.should_exit = True
    thread.join(timeout=10)
    deployed.shutdown()


@pytest.fixture(scope="module")
def single(model_dir, tmp_path_factory):
    """The single server with the same flags (no Redis), in-process, for comparison."""
    from fastapi.testclient import TestClient

    from kvwise.server.serve import build_app

    args = serve_args(model_dir, tmp_path_factory.mktemp("single"))
    with TestClient(build_app(args)) as client:
        yield client


def client_for(url: str, key: str = ALICE) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def test_the_cluster_answers_the_openai_client_as_the_single_server_does(cluster, single, model_dir):
    url, _, _ = cluster
    client = client_for(url)
    prompts = [prompt_ids(seed, 40) for seed in range(3)]
    expected = greedy_texts(model_dir, prompts, 8)
    for prompt, text in zip(prompts, expected):
        answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert answer.choices[0].text == text
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    single_chat = single.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0},
        headers={"Authorization": f"Bearer {ALICE}"},
    ).json()
    assert chat.choices[0].message.content == single_chat["choices"][0]["message"]["content"]
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6


@pytest.mark.parametrize(
    ("path", "body", "key"),
    [
        ("/v1/completions", b'{"model": "tiny", "prompt": ', ALICE),  # malformed JSON
        ("/v1/completions", b'{"model": "nope", "prompt": "x"}', ALICE),  # unknown model
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": -1}', ALICE),  # out of range
        ("/v1/completions", b'{"model": "tiny", "prompt": "x"}', "wrong-key"),  # unknown key
        ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', ALICE),
        ("/v1/nothing", b"{}", ALICE),
    ],
)
def test_errors_are_the_single_servers(cluster, single, path, body, key):
    url, _, _ = cluster
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    ours = httpx.post(f"{url}{path}", content=body, headers=headers, timeout=30)
    theirs = single.post(path, content=body, headers=headers)
    assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json())


def test_requests_sharing_a_prefix_go_where_it_is_and_tenants_never_share(cluster):
    url, _, _ = cluster
    served_by = {}
    for document in range(4):
        head = prompt_ids(100 + document, 120)
        for question in range(3):
            prompt = head + prompt_ids(200 + question, 8)
            response = client_for(url).completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=2)
            served_by.setdefault(document, []).append(response.headers["x-kvwise-replica"])
            if question:
                assert response.parse().usage.prompt_tokens_details.cached_tokens >= 116
    assert all(len(set(replicas)) == 1 for replicas in served_by.values())  # each document stays put
    assert len({replicas[0] for replicas in served_by.values()}) == 2  # and the documents spread
    bob = client_for(url, BOB).completions.create(model="tiny", prompt=prompt_ids(100, 120), max_tokens=2)
    assert bob.usage.prompt_tokens_details.cached_tokens == 0  # alice's blocks are not bob's, in any tier
    from kvwise.cluster.router_registry import ACTIVE_ROUTERS

    directory = ACTIVE_ROUTERS["kvwise-engine"].directory
    # every finished request leaves the router's load; Ray tells the router a moment after the
    # response has reached the client (well under a second). The loop ends as soon as the load is
    # gone; its deadline only bounds how long a real leak (which never clears) takes to fail, so
    # it is generous for a loaded machine
    deadline = time.monotonic() + 60
    while any(directory._in_flight.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(directory._in_flight.values())
    state = [*directory.shared, *(b for r in directory.reports.values() for b in r.device | r.host)]
    assert state and all(isinstance(block, int) for block in state)  # salted block names, nothing else


def test_metrics_join_the_replicas_with_a_replica_label(cluster):
    url, _, _ = cluster
    assert httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {BOB}"}).status_code == 403
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ALICE}"}).text
    assert "kvwise_cluster_replicas 2" in text
    labelled = {line.split('replica="')[1].split('"')[0] for line in text.splitlines() if 'replica="' in line}
    assert len(labelled) == 2
    assert text.count("# TYPE kvwise_requests_total") <= 1
    published = [line for line in text.splitlines() if line.startswith("kvwise_prefix_published_blocks_total")]
    assert published and sum(float(line.split()[-1]) for line in published) > 0


def _answers_while(url: str, fault, prompts, expected, stream_long: bool = False):
    """Send `prompts` from 4 threads; run `fault` once the first answer is back; every answer must
    be what one engine without tiers answers."""
    client = client_for(url)

    def ask(prompt):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, prompt) for prompt in prompts]
        futures[0].result(timeout=60)
        fault()
        return [future.result(timeout=90) for future in futures]


def test_a_redis_master_killed_mid_run_costs_recomputation_only_and_the_tier_recovers(
    cluster, redis_cluster, model_dir
):
    url, _, _ = cluster
    prompts = [prompt_ids(300 + seed % 6, 60) + prompt_ids(400 + seed, 6) for seed in range(24)]
    expected = greedy_texts(model_dir, prompts, 8)
    victim = masters(redis_cluster)[0]
    assert _answers_while(url, victim.kill, prompts, expected) == expected
    victim.restart()  # it comes back as a replica of the master that took over
    deadline, text = time.monotonic() + 60, ""
    while time.monotonic() < deadline:
        more = [prompt_ids(500 + seed, 70) for seed in range(2)]
        assert [client_for(url).completions.create(model="tiny", prompt=p, max_tokens=2).usage for p in more]
        text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ALICE}"}).text
        up = [line for line in text.splitlines() if line.startswith("kvwise_prefix_tier_up{")]
        if up and all(line.endswith(" 1.0") for line in up):
            break
        time.sleep(1)
    up = [line for line in text.splitlines() if line.startswith("kvwise_prefix_tier_up{")]
    assert len(up) == 2 and all(line.endswith(" 1.0") for line in up), up


def test_a_replica_killed_mid_run_leaves_no_request_unanswered_and_cuts_streams_cleanly(cluster, model_dir):
    url, deployed, _ = cluster
    client = client_for(url)
    long_stream = client.completions.with_raw_response.create(
        model="tiny",
        prompt=prompt_ids(900, 30),
        max_tokens=1900,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    victim = long_stream.headers["x-kvwise-replica"]
    events = long_stream.parse().__iter__()
    next(events)  # under way
    prompts = [prompt_ids(600 + seed, 50) for seed in range(16)]
    expected = greedy_texts(model_dir, prompts, 8)

    def kill():
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)

    answers = _answers_while(url, kill, prompts, expected)
    assert answers == expected
    with pytest.raises(openai.APIError) as cut:
        for _ in events:
            pass
    assert "replica" in str(cut.value)
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ALICE}"}).text
    assert "kvwise_cluster_lost_streams_total 1" in text
