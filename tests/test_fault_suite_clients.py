"""Fault suite, clients: a client that hangs up while its request is queued, prefilling, decoding
or streaming is cancelled there, leaves every block free or held by the prefix cache alone (no
lock), and a well-behaved stream beside it finishes intact; SIGTERM during streams lets them
finish, refuses new work and exits 0."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import threading
import time

import httpx
import pytest

from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.request import Status
from kvwise.models import load_model
from kvwise.server.app import ServerSettings, create_app
from tests.inprocess_server import InProcessServer
from tests.live_server import LiveServer
from tests.test_engine_core import assert_only_prefix_cache_holds_blocks
from tests.tiny_chars_model import greedy_texts, prompt_ids, save_tiny_llama

CANARY_PROMPT = prompt_ids(100, 20)
CANARY_TOKENS = 40
LONG_PROMPT = prompt_ids(101, 400)  # 27 steps of prefill at a budget of 16 tokens, the canary's one included
VICTIM_TOKENS = 100  # the long prompt's 400 and these fit the model's 512 positions
STEP_FLOOR_SECONDS = 0.02


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def canary_text(model_dir):
    return greedy_texts(model_dir, [CANARY_PROMPT], CANARY_TOKENS)[0]


@pytest.fixture(scope="module")
def server(model_dir):
    """Two running slots, so one is left for the canary; a floor on the step time, so that the
    canary is still decoding when the client under test hangs up, however fast the machine is."""
    model, tokenizer = load_model(str(model_dir), device="cpu")
    core = EngineCore(model, tokenizer, CacheConfig(block_size=4, num_blocks=256, token_budget=16, max_running=2))
    forward = core.runner.forward

    def slowed(*args, **options):
        time.sleep(STEP_FLOOR_SECONDS)
        return forward(*args, **options)

    core.runner.forward = slowed
    live = InProcessServer(create_app(core, ServerSettings("tiny", disconnect_poll_seconds=0.05)))
    yield live
    live.stop()


def send(server, prompt: list[int], max_tokens: int, stream: bool) -> socket.socket:
    """A completion request on a raw connection, so that the test decides when it closes."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}
    data = json.dumps(body).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: tiny\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(data)}"
    connection = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    connection.sendall(head.encode() + b"\r\n\r\n" + data)
    return connection


def read_events(connection: socket.socket, count: int) -> None:
    received = b""
    while received.count(b"data: ") < count:
        chunk = connection.recv(4096)
        assert chunk, "the server closed the stream early"
        received += chunk


def wait_for(condition, seconds: float = 30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError("timed out waiting")


def engine_request(core: EngineCore, prompt: list[int]):
    """The engine's Request for a prompt, once it is in the scheduler."""
    return next((r for r in list(core.scheduler.running) + list(core.scheduler.waiting) if r.prompt == prompt), None)


class Canary:
    """A well-behaved greedy stream, read to its end in a thread."""

    def __init__(self, server):
        self.text, self.finish = "", None
        body = {"model": "tiny", "prompt": CANARY_PROMPT, "max_tokens": CANARY_TOKENS, "temperature": 0}
        self.thread = threading.Thread(target=self._read, args=(server, {**body, "stream": True, "ignore_eos": True}))
        self.thread.start()
        self.request = wait_for(lambda: engine_request(server.engine.core, CANARY_PROMPT))

    def _read(self, server, body):
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as answer:
            for line in answer.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[len("data: ") :])["choices"][0]
                    self.text += choice["text"]
                    self.finish = choice["finish_reason"] or self.finish

    def result(self) -> tuple[str, str | None]:
        self.thread.join(60)
        return self.text, self.finish


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage", ["queued", "prefilling", "decoding", "streaming"])
def test_a_client_that_hangs_up_at_any_stage_is_cancelled_and_leaks_nothing(server, canary_text, stage, caplog):
    core = server.engine.core
    canary = Canary(server)
    blocker = None
    if stage == "queued":  # the canary and a long stream take both running slots
        blocker = send(server, prompt_ids(102, 12), max_tokens=400, stream=True)
        read_events(blocker, 1)
    prompt = LONG_PROMPT if stage == "prefilling" else prompt_ids(103, 12)
    victim_connection = send(server, prompt, max_tokens=VICTIM_TOKENS, stream=stage == "streaming")
    victim = wait_for(lambda: engine_request(core, prompt))
    if stage == "prefilling":
        wait_for(lambda: victim.computed > 0)
    elif stage == "decoding":
        wait_for(lambda: len(victim.output) >= 2)
    elif stage == "streaming":
        read_events(victim_connection, 3)
    victim_connection.close()
    wait_for(lambda: victim.status is Status.CANCELLED)
    assert not canary.request.done  # the canary was running beside it all along
    if stage == "queued":
        assert victim.computed == 0 and not victim.blocks
        blocker.close()  # and a hang-up mid-stream frees the blocker's slot
    elif stage == "prefilling":
        assert victim.output == [] and victim.computed < len(LONG_PROMPT)
    else:
        assert 2 <= len(victim.output) < VICTIM_TOKENS
    assert canary.result() == (canary_text, "length")
    wait_for(lambda: not core.scheduler.running and not core.scheduler.waiting)
    assert_only_prefix_cache_holds_blocks(core)
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]  # a hang-up is no error


@pytest.mark.timeout(120)
def test_sigterm_during_streams_finishes_them_refuses_new_work_and_exits_0(model_dir):
    prompts = [prompt_ids(seed, 10) for seed in (110, 111, 112)]
    max_tokens = 160
    expected = greedy_texts(model_dir, prompts, max_tokens)
    live = LiveServer("--model", str(model_dir), "--served-model-name", "tiny", "--device", "cpu")
    try:
        kept_alive = httpx.Client(base_url=live.base_url, timeout=30)
        assert kept_alive.get("/health").status_code == 200  # an open keep-alive connection
        with contextlib.ExitStack() as open_streams:
            streams = []
            for prompt in prompts:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
                body |= {"stream": True, "ignore_eos": True}
                response = open_streams.enter_context(
                    httpx.stream("POST", f"{live.base_url}/v1/completions", json=body, timeout=60)
                )
                lines = response.iter_lines()
                streams.append((lines, [next(line for line in lines if line.startswith("data: "))]))
            live.process.send_signal(signal.SIGTERM)
            for refused in (kept_alive, httpx.Client(base_url=live.base_url, timeout=30)):
                try:
                    answer = refused.post("/v1/completions", json={"model": "tiny", "prompt": [5], "max_tokens": 1})
                    assert answer.status_code == 503
                except httpx.TransportError:  # the listening socket is closed, or the idle connection
                    pass
            assert live.process.poll() is None  # still draining the streams
            for (lines, received), text in zip(streams, expected):
                received += [line for line in lines if line.startswith("data: ")]
                assert received[-1] == "data: [DONE]"
                chunks = [json.loads(line[len("data: ") :]) for line in received[:-1]]
                assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == text
                assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert live.process.wait(60) == 0
    finally:
        live.stop()
