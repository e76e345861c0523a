"""The HTTP API fuzzed from its own OpenAPI document with schemathesis: bodies that fit the
declared schemas and bodies that break them, against a live server on a tiny random model.
Nothing a client sends may answer 5xx (other than 503) or drop the connection."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.models import load_model
from kvwise.server.app import ServerSettings, create_app
from tests.base_model import CHAT_TEMPLATE, save_base_model
from tests.inprocess_server import InProcessServer


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    directory = save_base_model(tmp_path_factory.mktemp("fuzz-model"), max_positions=96)
    model, tokenizer = load_model(str(directory), device="cpu")
    core = EngineCore(model, tokenizer, CacheConfig(block_size=16, num_blocks=128))
    settings_ = ServerSettings("tiny", max_queue=8, chat_template=CHAT_TEMPLATE, default_max_tokens=8)
    server = InProcessServer(create_app(core, settings_))
    yield server
    server.stop()


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
    for operation in operations:

        @given(operation.as_strategy(generation_mode=mode))
        @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def call(case):
            response = case.call(base_url=fuzz_server.base_url, timeout=60)
            assert response.status_code < 500 or response.status_code == 503, (
                f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text[:300]}"
            )
            if response.status_code >= 400:
                assert response.json()["error"]["message"]

        call()
