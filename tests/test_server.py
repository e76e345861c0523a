"""A live `kvwise serve` on the embedded SmolLM2, driven with the official `openai` client."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.live_server import LiveServer

pytestmark = pytest.mark.smollm

MODEL = "SmolLM2-135M-Instruct"
KEYS = {
    "alice": "sk-alice-0001",
    "bob": "sk-bob-0002",
    "carol": "sk-carol-0003",
    "dave": "sk-dave-0005",
    "ops": "sk-ops-0004",
}
# ~150 tokens, well over one 16-token block, so a reused prefix shows in the hit counters
DOCUMENT = " ".join(f"Item {n} of the inventory is a {c} box." for n, c in enumerate(["red", "blue", "green"] * 6))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api_keys.txt"
    keys.write_text(
        "# key            tenant\n"
        f"{KEYS['alice']} alice shared-write\n{KEYS['bob']} bob   # a comment after an entry\n\n"
        f"{KEYS['carol']} carol shared\n{KEYS['dave']} dave shared-read\n{KEYS['ops']} ops admin\n"
    )
    live = LiveServer(
        "--api-keys",
        str(keys),
        "--max-queue",
        "4",
        "--max-running",
        "2",
        "--num-blocks",
        "512",
        "--metrics-per-tenant",
        "--no-fair-queue",  # the queue tests below count the global bound (fair shares: test_request_faults)
        metrics_key=KEYS["ops"],
    )
    yield live
    assert live.stop() == 0


def _series(sample: str) -> str:
    """The series a Prometheus sample belongs to: without _total, _bucket, _sum or _count."""
    for suffix in ("_total", "_bucket", "_sum", "_count"):
        if sample.endswith(suffix):
            return sample.removesuffix(suffix)
    return sample


def client(server, tenant="alice", **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEYS.get(tenant, tenant), max_retries=0, **options)


def test_models_completion_and_chat(server):
    api = client(server)
    assert [model.id for model in api.models.list()] == [MODEL]
    completion = api.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert completion.object == "text_completion" and completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 6 and completion.choices[0].text
    again = api.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert again.choices[0].text == completion.choices[0].text  # greedy is deterministic
    chat = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in chat.choices[0].logprobs.content)
    several = api.completions.create(model=MODEL, prompt=["One,", "Two,"], max_tokens=3, n=2, temperature=0.8, seed=1)
    assert sorted(choice.index for choice in several.choices) == [0, 1, 2, 3]


def test_streaming_equals_the_whole_answer(server):
    api = client(server)
    whole = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=20, temperature=0
    )
    stream = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    logged = [
        chunk
        for chunk in api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=20,
            temperature=0,
            stream=True,
            logprobs=True,
            top_logprobs=2,
        )
        if chunk.choices and chunk.choices[0].logprobs
    ]
    entries = [entry for chunk in logged for entry in chunk.choices[0].logprobs.content]
    assert "".join(entry.token for entry in entries) == whole.choices[0].message.content
    assert all(len(entry.top_logprobs) == 2 for entry in entries)
    pieces = list(api.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=12, temperature=0, stream=True))
    plain = api.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=12, temperature=0)
    assert "".join(piece.choices[0].text for piece in pieces) == plain.choices[0].text


def test_stop_strings_in_streams(server):
    api = client(server)
    whole = api.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[" 7"])
    streamed = "".join(
        piece.choices[0].text
        for piece in api.completions.create(
            model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[" 7"], stream=True
        )
    )
    assert whole.choices[0].finish_reason == "stop" and " 7" not in whole.choices[0].text
    assert streamed == whole.choices[0].text


def test_per_request_kv_policy(server):
    api = client(server)
    long_prompt = f"Read this. {DOCUMENT} Which colour is item 2?"
    squeezed = api.completions.create(
        model=MODEL,
        prompt=long_prompt,
        max_tokens=4,
        temperature=0,
        extra_body={"kv_policy": "snapkv", "kv_ratio": 0.5, "ignore_eos": True},
    )
    assert squeezed.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError, match="unknown policy"):
        api.completions.create(
            model=MODEL, prompt="hi", max_tokens=1, extra_body={"kv_policy": "nope", "kv_ratio": 0.5}
        )
    quantized = api.completions.create(
        model=MODEL,
        prompt=long_prompt,
        max_tokens=4,
        temperature=0,
        extra_body={"kv_quant": "kivi4", "ignore_eos": True},
    )
    assert quantized.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError, match="unknown quantizer"):
        api.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"kv_quant": "int3"})
    with pytest.raises(openai.BadRequestError, match="kv_ratio"):
        api.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"kv_ratio": 1.5})


def test_errors(server):
    api = client(server)
    with pytest.raises(openai.AuthenticationError):
        client(server, "sk-wrong").completions.create(model=MODEL, prompt="hi", max_tokens=1)
    missing = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        api.completions.create(model="gpt-nope", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        api.completions.create(model=MODEL, prompt="hi", max_tokens=1, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="outside the model's vocabulary"):
        api.completions.create(model=MODEL, prompt=[5, 10**9], max_tokens=1)
    with pytest.raises(openai.UnprocessableEntityError):
        api.completions.create(model=MODEL, prompt="hi", max_tokens="many")
    with pytest.raises(openai.APIStatusError, match="maximum context is 8192") as too_long:
        api.completions.create(model=MODEL, prompt=[1] * 9000, max_tokens=4)
    assert too_long.value.status_code == 413
    headers = {"Authorization": f"Bearer {KEYS['alice']}", "Content-Type": "application/json"}
    malformed = httpx.post(f"{server.base_url}/v1/chat/completions", content=b'{"model": "x", ', headers=headers)
    assert malformed.status_code == 422 and "not valid JSON" in malformed.json()["error"]["message"]
    route = httpx.get(f"{server.base_url}/v1/nothing-here", headers=headers)
    assert route.status_code == 404 and "error" in route.json()
    huge = httpx.post(f"{server.base_url}/v1/completions", content=b"x" * (9 * 1024 * 1024), headers=headers)
    assert huge.status_code == 413


def test_fields_clients_send_are_ignored_or_refused_by_name(server):
    api = client(server)
    ignored = {
        "metadata": {"session": "42"},
        "store": False,
        "service_tier": "auto",
        "parallel_tool_calls": False,
        "response_format": {"type": "text"},
        "tool_choice": "none",
    }
    plain = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4, temperature=0
    )
    answer = api.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=4,
        temperature=0,
        user="u1",
        **ignored,
    )
    assert answer.parse().choices[0].message.content == plain.choices[0].message.content  # nothing changed
    warning = answer.headers["warning"]
    assert all(name in warning for name in ("metadata", "store", "service_tier", "parallel_tool_calls"))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    refused = {
        "tools": {"tools": [tool]},
        "logit_bias": {"logit_bias": {"42": 5.0}},
        "response_format": {"response_format": {"type": "json_object"}},
        "tool_choice": {"tool_choice": {"type": "function", "function": {"name": "f"}}},
    }
    for field, extra in refused.items():
        with pytest.raises(openai.BadRequestError) as error:
            api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1, **extra
            )
        assert error.value.body["param"] == field and field in error.value.body["message"]


def test_tenants_do_not_share_prefixes_unless_they_opt_in(server):
    def hits(tenant):
        return server.value("kvwise_prefix_cache_hits_tokens_total", tenant=tenant)

    prompt = f"Alice's private notes. {DOCUMENT} Question: what is item 4?"
    first = client(server, "alice").completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    before = hits("alice")
    again = client(server, "alice").completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert hits("alice") - before >= 128  # alice reuses her own prefix
    # and the client reads it: the tokens the hit counter gained, in whole blocks
    assert again.usage.prompt_tokens_details.cached_tokens == hits("alice") - before

    def streamed_usage():
        stream = client(server, "alice").chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=1,
            stream=True,
            stream_options={"include_usage": True},
        )
        return [chunk.usage for chunk in stream if chunk.usage][0]

    streamed_usage()
    assert streamed_usage().prompt_tokens_details.cached_tokens >= 128  # streams carry it too
    bob = client(server, "bob").completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert hits("bob") == 0  # bob never sees alice's blocks
    assert bob.usage.prompt_tokens_details.cached_tokens == 0
    assert server.value("kvwise_prefix_cache_queries_tokens_total", tenant="bob") > 0

    # the shared namespace holds only the marked segment (128 tokens), never the rest of a prompt
    system = f"A public system prompt. {DOCUMENT}"
    marked = {"kv_prefix": {"tokens": 128, "shared": True}}
    rest = " Question: what is item 9?"
    client(server, "alice").completions.create(model=MODEL, prompt=system + rest, max_tokens=1, extra_body=marked)
    before = hits("dave")
    client(server, "dave").completions.create(model=MODEL, prompt=system + rest, max_tokens=1, extra_body=marked)
    assert hits("dave") - before == 128  # the shared segment, and not alice's private rest
    with pytest.raises(openai.PermissionDeniedError):  # bob's key has no shared permission
        client(server, "bob").completions.create(model=MODEL, prompt=system, max_tokens=1, extra_body=marked)
    before = hits("carol")
    tokens_only = {"kv_prefix": {"tokens": 128}}  # carol's key is `shared`: the marked segment is shared
    client(server, "carol").completions.create(model=MODEL, prompt=system + " Hi", max_tokens=1, extra_body=tokens_only)
    assert hits("carol") - before == 128


def test_metrics_need_an_admin_key(server):
    assert httpx.get(f"{server.base_url}/metrics", timeout=10).status_code == 401
    bob = {"Authorization": f"Bearer {KEYS['bob']}"}
    assert httpx.get(f"{server.base_url}/metrics", headers=bob, timeout=10).status_code == 403
    assert server.metrics()  # the admin key reads them
    documented = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    exported = {_series(name) for name, _ in server.metrics()}
    assert {name for name in exported if f"`{name}`" not in documented} == set()  # every series documented


def test_concurrent_requests_and_a_full_queue(server):
    api = client(server)
    results, errors = [], []

    def call(index):
        try:
            answer = api.completions.create(model=MODEL, prompt=f"Story {index}: once", max_tokens=24, temperature=0)
            results.append(answer.choices[0].text)
        except openai.RateLimitError as error:
            errors.append(error)

    threads = [threading.Thread(target=call, args=(index,)) for index in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) + len(errors) == 12
    assert len(results) >= 5 and errors  # 2 running + 4 queued fit; the rest are told to retry
    assert errors[0].response.headers["retry-after"] == "1"
    assert server.value("kvwise_requests_total", outcome="rejected_queue_full") == len(errors)


def test_a_disconnect_mid_stream_cancels_and_frees(server):
    cancelled = server.value("kvwise_requests_total", outcome="cancelled")
    headers = {"Authorization": f"Bearer {KEYS['alice']}"}
    body = {
        "model": MODEL,
        "prompt": "Write a long story about a dragon.",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=60) as response:
        lines = response.iter_lines()
        received = [line for _, line in zip(range(6), lines) if line.startswith("data: ")]
        assert json.loads(received[0][len("data: ") :])["object"] == "text_completion"
    deadline = time.monotonic() + 30
    while server.value("kvwise_requests_total", outcome="cancelled") == cancelled and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.value("kvwise_requests_total", outcome="cancelled") == cancelled + 1
    assert server.value("kvwise_running_requests") == 0
    # every block in use is held by the prefix cache alone
    assert server.value("kvwise_kv_blocks", state="used") == server.value("kvwise_kv_blocks", state="prefix_cached")
    assert server.value("kvwise_time_to_first_token_seconds_count") > 0


def test_graceful_shutdown_drains_a_running_stream():
    live = LiveServer("--max-running", "2")
    api = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0)
    stream = api.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=40,
        stream=True,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(stream))
    live.process.send_signal(__import__("signal").SIGTERM)
    rest = list(stream)
    assert first.choices[0].text is not None and rest[-1].choices[0].finish_reason == "length"
    assert live.process.wait(60) == 0
