"""The HTTP API fuzzed from its own OpenAPI document with schemathesis: bodies that fit the
declared schemas and bodies that break them, against a live server on a tiny random model.
Nothing a client sends may answer 5xx (other than 503) or drop the connection, and a canary
tenant streaming greedily all the while gets the same text every time, in steps shared with
the fuzzer's requests."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.models import load_model
from kvwise.server.api_keys import KeyEntry
from kvwise.server.app import ServerSettings, create_app
from tests.base_model import CHAT_TEMPLATE, save_base_model
from tests.inprocess_server import InProcessServer

FUZZER = {"Authorization": "Bearer sk-fuzzer"}
CANARY = {"Authorization": "Bearer sk-canary"}


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    directory = save_base_model(tmp_path_factory.mktemp("fuzz-model"), max_positions=96)
    model, tokenizer = load_model(str(directory), device="cpu")
    core = EngineCore(model, tokenizer, CacheConfig(block_size=16, num_blocks=128))
    keys = {"sk-fuzzer": KeyEntry("fuzzer"), "sk-canary": KeyEntry("canary")}
    settings_ = ServerSettings("tiny", keys, max_queue=8, chat_template=CHAT_TEMPLATE, default_max_tokens=8)
    server = InProcessServer(create_app(core, settings_))
    yield server
    server.stop()


class CanaryLoop:
    """Greedy streams of the canary tenant, one after another in a thread, each compared with the
    text it gives when nobody else is there."""

    BODY = {"model": "tiny", "prompt": "canary", "max_tokens": 48, "temperature": 0, "ignore_eos": True}

    def __init__(self, base_url: str):
        self.url = f"{base_url}/v1/completions"
        self.expected = self._once()
        self.runs, self.wrong = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _once(self) -> str:
        text = ""
        with httpx.stream("POST", self.url, json={**self.BODY, "stream": True}, headers=CANARY, timeout=60) as answer:
            assert answer.status_code == 200, answer.read()
            for line in answer.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                text = self._once()
            except Exception as error:  # noqa: BLE001 - reported by the test
                text = f"<{type(error).__name__}: {error}>"
            self.runs += 1
            if text != self.expected:
                self.wrong.append(text)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)


def assert_canary_shared_steps_with_the_fuzzer(core) -> None:
    shared = sum(1 for record in core.step_log if {tenant for _, tenant, _, _ in record.chunks} >= {"canary", "fuzzer"})
    assert shared > 0, "the canary never ran in the same step as a fuzzer's request"


def test_both_completion_endpoints_declare_their_bodies(fuzz_server):
    import httpx

    paths = httpx.get(f"{fuzz_server.base_url}/openapi.json", timeout=10).json()["paths"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith(("CompletionRequest", "ChatRequest"))


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_no_input_gives_a_server_error(fuzz_server, mode):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json")
    operations = [result.ok() for result in schema.include(path_regex=r"^/v1/").get_all_operations()]
    assert {operation.path for operation in operations} >= {"/v1/completions", "/v1/chat/completions"}
    if mode is GenerationMode.NEGATIVE:  # only a body can be made invalid
        operations = [operation for operation in operations if operation.method.upper() == "POST"]
    canary, served = CanaryLoop(fuzz_server.base_url), [0]
    try:
        for operation in operations:

            @given(operation.as_strategy(generation_mode=mode))
            @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def call(case):
                served[0] += 1
                if isinstance(case.body, dict) and "model" in case.body and served[0] % 2:
                    case.body["model"] = "tiny"  # every other body reaches the engine, beside the canary
                response = case.call(base_url=fuzz_server.base_url, timeout=60, headers=FUZZER)
                assert response.status_code < 500 or response.status_code == 503, (
                    f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text[:300]}"
                )
                if response.status_code >= 400:
                    assert response.json()["error"]["message"]

            call()
    finally:
        canary.stop()
    # stop() waits for the stream in flight, so at least one ran beside the fuzzer from start to end
    assert canary.runs >= 1 and not canary.wrong, (canary.runs, canary.wrong[:3], canary.expected)
    if mode is GenerationMode.POSITIVE:  # invalid bodies are refused before the engine: only valid ones share steps
        assert_canary_shared_steps_with_the_fuzzer(fuzz_server.engine.core)
