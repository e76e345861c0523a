"""`kv_prefix.compress` on a live server with the embedded SmolLM2 and the official `openai`
client: a document compressed once (query-agnostically) answers later questions from its
compressed KV, and bad compression options get a specific 400 before reaching the engine."""

from __future__ import annotations

import openai
import pytest

from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.server.app import ServerSettings, create_app
from tests.inprocess_server import InProcessServer

pytestmark = [pytest.mark.smollm, pytest.mark.timeout(600)]

MODEL = "SmolLM2-135M-Instruct"
DOCUMENT = " ".join(f"Locker {n} holds a {c} umbrella." for n, c in enumerate(["red", "blue", "green", "white"] * 5))


@pytest.fixture(scope="module")
def served(smollm):
    model, tokenizer = smollm
    core = EngineCore(model, tokenizer, CacheConfig(num_blocks=512, token_budget=512))
    with InProcessServer(create_app(core, ServerSettings(MODEL))) as server:
        yield server, core
    model.set_attn_implementation("kvwise")  # the session's model goes back to the cache's attention


def ask(server, question: str, **prefix):
    api = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    messages = [
        {"role": "system", "content": "Answer from the document."},
        {"role": "user", "content": DOCUMENT},
        {"role": "user", "content": question},
    ]
    return api.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"kv_prefix": {"messages": 2, **prefix}},
    )


def test_a_compressed_document_answers_later_questions(served):
    server, core = served
    first = ask(server, "Which colour is the umbrella in locker 2?", compress="kvzip@0.75")
    hits = core.kv.stats().compressed_hits
    second = ask(server, "Which colour is the umbrella in locker 5?", compress="kvzip@0.75")
    assert core.kv.stats().compressed_hits == hits + 1
    assert first.choices[0].message.content and second.choices[0].message.content
    entry = next(iter(core.kv.compressed_entries()))
    full_bytes = len(entry.tokens) * core.kv._storage.nbytes() // (core.kv.num_blocks * core.kv.block_size)
    assert entry.region.num_pages * core.kv._head_pages.page_bytes < 0.4 * full_bytes
    another_mix = ask(server, "Which colour is the umbrella in locker 5?", compress="snapkv@0.5+kivi4")
    assert another_mix.choices[0].finish_reason in ("stop", "length")
    assert core.kv.stats().compressed_hits == hits + 1  # another mix is another entry


@pytest.mark.parametrize(
    ("prefix", "message"),
    [
        ({"compress": "kvzip:nope=1@0.9"}, "nope"),
        ({"compress": "kivi4"}, "needs a policy with a ratio"),
        ({"compress": "kvzip@1.5"}, "ratio"),
        ({"compress": "kvzip@0.9", "shared": True}, "cannot also be shared"),
        ({"compress": "kvzip@0.9", "messages": 9}, "kv_prefix.messages is 9"),
    ],
)
def test_bad_compression_options_are_specific_400s(served, prefix, message):
    server, core = served
    steps = core.steps
    with pytest.raises(openai.BadRequestError, match=message):
        ask(server, "Which colour?", **prefix)
    assert core.steps == steps  # refused before the engine saw it


def test_a_whole_mix_per_request(served):
    server, core = served
    api = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    prompt = f"{DOCUMENT} Which colour is the umbrella in locker 3?"
    answer = api.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        extra_body={"kv_mix": "kvzip@0.9+kivi4", "ignore_eos": True},
    )
    assert answer.usage.completion_tokens == 4
    steps = core.steps
    for body, message in [
        ({"kv_mix": "kvzip@0.9", "kv_policy": "snapkv"}, "leave out kv_policy"),
        ({"kv_mix": "kvzip@0.9+kivi3"}, "kv_mix"),
        ({"kv_mix": "kvzip@0.9+kivi4:group_size=16,residual_length=32"}, "not enabled on this server"),
    ]:
        with pytest.raises(openai.BadRequestError, match=message):
            api.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=body)
    assert core.steps == steps  # refused before the engine saw them
