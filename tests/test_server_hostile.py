"""A hostile client against a live server on the embedded model (in-process uvicorn on loopback,
the official `openai` client and raw HTTP): every poison input gets a specific 4xx or is made safe,
and a canary stream of another tenant decoding beside it finishes intact."""

from __future__ import annotations

import json
import re
import statistics
import threading
import time

import httpx
import openai
import pytest

from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.server.api_keys import load_api_keys
from kvwise.server.app import ServerSettings, create_app
from tests.inprocess_server import InProcessServer

pytestmark = pytest.mark.smollm

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"alice": "sk-alice-1", "bob": "sk-bob-2"}
CANARY_PROMPT = "Write a long list of fruits, one per line:"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    global server_url
    import kvwise

    model, tokenizer = kvwise.load_model(device="cpu")  # its own copy: the engine switches its attention
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    core = EngineCore(model, tokenizer, CacheConfig(num_blocks=512))
    live = InProcessServer(create_app(core, ServerSettings(MODEL, load_api_keys(str(keys)), max_queue=16)))
    server_url = live.base_url
    yield live
    live.stop()


def client(tenant="alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=120)


server_url = ""  # set by the `server` fixture


class Canary:
    """A greedy stream of bob's, started before the poison and read to its end in a thread."""

    def __init__(self, tokens: int = 48):
        self.text, self.finish, self.error, self.started = "", None, None, threading.Event()
        self.expected_tokens = tokens
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.started.wait(120)

    def _run(self):
        try:
            stream = client("bob").completions.create(
                model=MODEL,
                prompt=CANARY_PROMPT,
                max_tokens=self.expected_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                self.started.set()
                self.text += chunk.choices[0].text
                self.finish = chunk.choices[0].finish_reason or self.finish
        except Exception as error:  # noqa: BLE001 - reported by the test
            self.error = error
            self.started.set()

    def result(self):
        self.thread.join(180)
        return self.error, self.finish, self.text


@pytest.fixture(scope="module")
def canary_text(server):
    """What the canary says when nobody disturbs it (greedy: the same every time)."""
    error, finish, text = Canary().result()
    assert error is None and finish == "length"
    return text


_http = httpx.Client(timeout=60)  # one keep-alive connection for the many small requests


def raw(path: str, body: bytes, tenant="alice") -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}", "Content-Type": "application/json"}
    return _http.post(f"{server_url}{path}", content=body, headers=headers)


def assert_canary_decoded_beside_the_poison(server):
    """The step log shows a step where bob's canary decoded while alice's request was computed."""
    for record in server.engine.core.step_log:
        tenants = {tenant for _, tenant, _, _ in record.chunks}
        canary_decoding = any(tenant == "bob" and end - start == 1 for _, tenant, start, end in record.chunks)
        if canary_decoding and "alice" in tenants:
            return
    raise AssertionError("the canary never decoded in the same step as the poison request")


ACCEPTED_POISON = {  # values that used to crash a step: now safe, the request is answered
    "temperature 1e-40": {"temperature": 1e-40},
    "temperature 5e-324": {"temperature": 5e-324},
    "top_p 1e-300": {"top_p": 1e-300, "temperature": 1.0},
}


@pytest.mark.parametrize("name", sorted(ACCEPTED_POISON))
def test_values_that_broke_the_step_are_safe_beside_a_canary(server, canary_text, name):
    canary = Canary()
    answer = client().completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=24,
        extra_body={"ignore_eos": True},
        **ACCEPTED_POISON[name],
    )
    assert answer.choices[0].finish_reason == "length"
    error, finish, text = canary.result()
    assert error is None and finish == "length" and text == canary_text
    assert_canary_decoded_beside_the_poison(server)


REFUSED_POISON = {
    "kv_quant that does not fit": ({"kv_quant": "kivi4:value_group_size=7"}, 400, "value group|not enabled"),
    "a quantizer spelling not enabled": ({"kv_quant": "kivi4:group_size=16"}, 400, "not enabled on this server"),
    "n of a billion": ({"n": 10**9}, 400, "more than this server queues"),
    "too many stop strings": ({"stop": [f"s{i}" for i in range(17)]}, 400, "at most 16 stop strings"),
    "a stop string too long": ({"stop": ["x" * 300]}, 400, "at most 256 characters"),
    "infinite temperature": ({"temperature": 1e400}, 400, "temperature"),
}


@pytest.mark.parametrize("name", sorted(REFUSED_POISON))
def test_poison_values_get_a_specific_4xx_and_the_canary_goes_on(server, canary_text, name):
    fields, status, message = REFUSED_POISON[name]
    canary = Canary()
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}
    answer = raw("/v1/completions", json.dumps(body).replace("Infinity", "1e400").encode())
    assert answer.status_code == status, answer.text
    assert re.search(message, answer.json()["error"]["message"]), answer.text
    error, finish, canary_out = canary.result()
    assert error is None and canary_out == canary_text


MALFORMED = {
    "10k nested lists": b'{"model": "' + MODEL.encode() + b'", "prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}",
    "surrogate in prompt": json.dumps({"model": MODEL, "prompt": "a\ud800b"}).encode(),
    "surrogate in model": json.dumps({"model": "x\udfff", "prompt": "a"}).encode(),
    "surrogate in a key": b'{"model": "' + MODEL.encode() + b'", "prompt": "a", "\\ud800": 1}',
    "invalid utf-8": b'{"model": "' + MODEL.encode() + b'", "prompt": "\xff\xfe"}',
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_bodies_get_4xx_never_a_500_or_a_reset(server, name):
    for path in ("/v1/completions", "/v1/chat/completions"):
        answer = raw(path, MALFORMED[name])
        assert 400 <= answer.status_code < 500, (path, answer.status_code, answer.text)
        assert answer.json()["error"]["message"]


def test_surrogates_in_chat_content_get_400(server):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi \udc00"}]}).encode()
    answer = raw("/v1/chat/completions", body)
    assert answer.status_code == 400 and "surrogate" in answer.json()["error"]["message"]


def test_a_thousand_quantizer_spellings_build_at_most_the_allowed_pools(server):
    # 50 spellings of the default kivi4 (repeated options, case) and 950 of quantizers not enabled
    same = [("KIVI4" if i % 2 else "kivi4") + ":sink_tokens=1" * i for i in range(50)]
    other = [f"kivi4:group_size={2 ** (i % 4)}:residual_length={64 * (1 + i)}" for i in range(950)]
    statuses = {}
    for spelling in same + other:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "kv_quant": spelling}
        status = raw("/v1/completions", json.dumps(body).encode()).status_code
        statuses[status] = statuses.get(status, 0) + 1
    assert statuses == {200: 50, 400: 950}
    assert len(server.engine.core.kv._quant_pools) <= 1  # one pool: the canonical kivi4


def test_n_of_a_billion_is_refused_at_once_and_health_stays_fast(server):
    def health_latency() -> float:
        started = time.perf_counter()
        assert httpx.get(f"{server_url}/health", timeout=10).status_code == 200
        return time.perf_counter() - started

    def refusal_seconds(n: int) -> float:
        body = json.dumps({"model": MODEL, "prompt": ["a", "b"], "n": n, "max_tokens": -1}).encode()
        started = time.perf_counter()
        assert raw("/v1/completions", body).status_code == 400
        return time.perf_counter() - started

    before = statistics.median(health_latency() for _ in range(5))
    # the baseline: the same request refused for its max_tokens, with a small n
    baseline = statistics.median(refusal_seconds(2) for _ in range(5))
    body = json.dumps({"model": MODEL, "prompt": ["a", "b"], "n": 10**9, "max_tokens": 1}).encode()
    started = time.perf_counter()
    answer = raw("/v1/completions", body)
    elapsed = time.perf_counter() - started
    after = statistics.median(health_latency() for _ in range(5))
    # ratios to baselines of this test: work in proportion to n (10^9 choices) would take minutes,
    # so 20x a refusal (at least a second, for one slow scheduling on a loaded machine) is "at once"
    assert answer.status_code == 400 and elapsed < max(1.0, 20 * baseline), (answer.status_code, elapsed, baseline)
    assert after < max(0.5, 10 * before), (before, after)


def test_health_live_and_ready(server):
    for path in ("/health", "/health/live", "/health/ready"):
        assert httpx.get(f"{server_url}{path}", timeout=10).status_code == 200


def test_a_slowloris_client_is_closed_after_the_header_timeout(tmp_path):
    """Headers sent a byte at a time: the connection is closed once the deadline passes, while a
    normal client on the same server is answered."""
    import socket

    from kvwise.server.slow_clients import header_timeout_protocol
    from tests.base_model import save_base_model

    directory = save_base_model(tmp_path / "model", max_positions=64)
    from kvwise.models import load_model

    model, tokenizer = load_model(str(directory), device="cpu")
    core = EngineCore(model, tokenizer, CacheConfig(block_size=16, num_blocks=32))
    slow = InProcessServer(create_app(core, ServerSettings("tiny")), http=header_timeout_protocol(1.0))
    try:
        connection = socket.create_connection(("127.0.0.1", slow.port))
        connection.settimeout(5)
        started = time.monotonic()
        closed_after = None
        slow_bytes = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
        sending_seconds = 0.05 * len(slow_bytes)  # about 7 s at a byte every 50 ms
        for byte in slow_bytes:
            try:
                connection.send(bytes([byte]))
                time.sleep(0.05)
            except OSError:
                closed_after = time.monotonic() - started
                break
        if closed_after is None:
            assert connection.recv(1024) == b""  # the server closed it
            closed_after = time.monotonic() - started
        # not before the 1 s deadline (less the moment between accept and our first byte), and by
        # the server while the client was still sending: it would have sent for 5 s more
        assert 0.9 < closed_after < sending_seconds, (closed_after, sending_seconds)
        assert httpx.get(f"{slow.base_url}/health", timeout=5).status_code == 200
    finally:
        slow.stop()


def test_a_dead_engine_thread_fails_new_requests_at_once_with_503(tmp_path):
    from kvwise.models import load_model
    from tests.base_model import save_base_model

    model, tokenizer = load_model(str(save_base_model(tmp_path / "model", max_positions=64)), device="cpu")
    core = EngineCore(model, tokenizer, CacheConfig(block_size=16, num_blocks=32))
    live = InProcessServer(create_app(core, ServerSettings("tiny")))
    try:

        def die():
            raise SystemExit("the engine thread died")  # not an Exception: the loop does not catch it

        live.engine._turn = die
        live.engine._wake.set()
        live.engine._thread.join(10)
        assert not live.engine._thread.is_alive()
        started = time.perf_counter()
        answer = httpx.post(f"{live.base_url}/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=30)
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_down"
        # a request queued for the dead engine would wait for the client's 30 s timeout; "at once"
        # is anything well short of that, with room for a loaded machine
        assert time.perf_counter() - started < 5.0
        assert httpx.get(f"{live.base_url}/health/live", timeout=5).status_code == 503
    finally:
        live.stop()
