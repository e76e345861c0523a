"""The engine scores a continuation: prompt logprobs in the engine, and `echo` with `logprobs`
(and vLLM's `prompt_logprobs`) through the official `openai` client, in the shape that
lm-evaluation-harness's loglikelihood requests read."""

from __future__ import annotations

import math

import pytest
import torch

from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.sampling import SamplingParams
from kvwise.models import load_model
from kvwise.policies.mix import Mix
from kvwise.server.app import ServerSettings, create_app
from tests.conftest import TINY_MODELS, random_ids
from tests.inprocess_server import InProcessServer
from tests.tiny_chars_model import save_tiny_llama

pytestmark = pytest.mark.timeout(300)


def _own_forward(model, ids: torch.Tensor) -> torch.Tensor:
    """[n - 1] log-probabilities of ids[1:] from the model's own forward (SDPA, no kvwise)."""
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        log_probs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return log_probs[torch.arange(ids.shape[1] - 1), ids[0, 1:]]


def _score(core, ids, top=0, **request):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=top)
    scored = core.make_request(ids[0].tolist(), params, **request)
    core.add(scored)
    while core.has_work:
        core.step()
    assert scored.error is None
    return scored


def test_under_the_full_cache_prompt_logprobs_equal_the_models_forward():
    model = TINY_MODELS["llama"]()
    ids = random_ids(1, 70, seed=2)
    # chunked prefill (16 tokens a step) and a prefix cache that holds the prompt already
    core = EngineCore(model, None, CacheConfig(block_size=4, num_blocks=128, token_budget=16))
    warm = core.make_request(ids[0].tolist(), SamplingParams(temperature=0, max_tokens=1))
    core.add(warm)
    while core.has_work:
        core.step()
    scored = _score(core, ids, top=3)
    expected = _own_forward(model, ids)
    assert scored.prompt_logprobs[0] is None and scored.reused == 0  # cached tokens are computed again
    got = torch.tensor([next(iter(entry.values())) for entry in scored.prompt_logprobs[1:]])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert all(len(entry) >= 3 for entry in scored.prompt_logprobs[1:])  # the token and its top 3, maybe overlapping
    assert all(rank >= 1 for rank in scored.prompt_ranks[1:])


def test_a_continuation_is_scored_under_the_compressed_quantized_context():
    """After `compress_upto`, the rest is scored under the region as stored: it differs from the
    full cache's score, the context's own tokens (computed before the compression) do not."""
    model = TINY_MODELS["llama"]()
    ids = random_ids(1, 80, seed=4)
    core = EngineCore(model, None, CacheConfig(block_size=4, num_blocks=256, prefix_caching=False))
    settings = Mix("snapkv", ratio=0.7, quant="kivi2")
    scored = _score(core, ids, kv=settings, compress_upto=60)
    expected = _own_forward(model, ids)
    got = torch.tensor([next(iter(entry.values())) for entry in scored.prompt_logprobs[1:]])
    torch.testing.assert_close(got[:59], expected[:59], atol=1e-4, rtol=0)
    assert float((got[59:] - expected[59:]).abs().max()) > 1e-3
    assert all(math.isfinite(value) for value in got.tolist())


@pytest.mark.parametrize("quant", ["kivi2:residual_length=8:group_size=8", None])
def test_a_continuation_is_scored_by_forced_token_decoding_as_generation_read_it(quant):
    """Scoring the tokens a request generated, after the same compressed prompt, gives each the
    log-probability it was generated with: they are read one a step, as decoding reads them, so
    tokens settle into 2-bit groups (and a cap evicts) at the same points."""
    model = TINY_MODELS["llama"]()
    prompt = random_ids(1, 60, seed=5)[0].tolist()
    core = EngineCore(model, None, CacheConfig(block_size=4, num_blocks=256, prefix_caching=False))
    if quant:
        settings = Mix("snapkv", ratio=0.5, quant=quant)
    else:
        settings = Mix("streaming_llm", ratio=0.5, max_tokens=40)
    generated = core.make_request(prompt, SamplingParams(temperature=0, max_tokens=48, logprobs=0), kv=settings)
    core.add(generated)
    while core.has_work:
        core.step()
    assert generated.error is None and len(generated.output) == 48
    expected = torch.tensor([entry[token] for entry, token in zip(generated.logprobs, generated.output)])
    ids = torch.tensor([prompt + generated.output[:-1]])
    scored = _score(core, ids, kv=settings, compress_upto=len(prompt))
    got = torch.tensor([next(iter(entry.values())) for entry in scored.prompt_logprobs[len(prompt) :]])
    torch.testing.assert_close(got, expected[:-1], atol=1e-4, rtol=0)


def test_decode_from_reads_the_rest_one_token_a_step_under_the_full_cache():
    """`decode_from` without a mix: the first part is one prefill, the rest one token a step
    through the decode path, and the scores still equal the model's own forward."""
    model = TINY_MODELS["llama"]()
    ids = random_ids(1, 40, seed=6)
    core = EngineCore(model, None, CacheConfig(block_size=4, num_blocks=128, prefix_caching=False))
    chunks, schedule = [], core.scheduler.schedule

    def recording():
        step = schedule()
        chunks.append([chunk.end - chunk.start for chunk in step.prefills])
        return step

    core.scheduler.schedule = recording
    scored = _score(core, ids, decode_from=30)
    assert [sizes for sizes in chunks if sizes] == [[30]] + [[1]] * 10
    got = torch.tensor([next(iter(entry.values())) for entry in scored.prompt_logprobs[1:]])
    torch.testing.assert_close(got, _own_forward(model, ids), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="decode_from must be between 1 and the prompt's 40 tokens, got 41"):
        core.make_request(ids[0].tolist(), SamplingParams(max_tokens=1, prompt_logprobs=0), decode_from=41)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model, tokenizer = load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))), device="cpu")
    core = EngineCore(model, tokenizer, CacheConfig(block_size=4, num_blocks=256, token_budget=32))
    live = InProcessServer(create_app(core, ServerSettings("tiny")))
    yield live, model, tokenizer
    live.stop()


def test_echo_with_logprobs_through_the_official_client_as_a_harness_reads_it(server):
    import openai

    live, model, tokenizer = server
    client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="unused")
    context, continuation = "The cat sat on the ", "mat by the door."
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    whole = context_ids + tokenizer(continuation, add_special_tokens=False)["input_ids"]
    # lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs, one token generated
    answer = client.completions.create(model="tiny", prompt=whole, max_tokens=1, logprobs=1, echo=True, temperature=0)
    choice = answer.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.token_logprobs) == len(whole) + 1 and logprobs.token_logprobs[0] is None
    expected = _own_forward(model, torch.tensor([whole]))
    harness_view = logprobs.token_logprobs[len(context_ids) : -1]  # what the harness sums
    torch.testing.assert_close(torch.tensor(harness_view), expected[len(context_ids) - 1 :], atol=1e-4, rtol=0)
    assert all(len(top) >= 1 for top in logprobs.top_logprobs[1:])
    assert choice.text.startswith(tokenizer.decode(whole))
    # max_tokens 0: the prompt scored, nothing generated; vLLM's prompt_logprobs by token id
    scored = client.completions.create(
        model="tiny", prompt=whole, max_tokens=0, logprobs=0, echo=True, extra_body={"prompt_logprobs": 2}
    )
    choice = scored.choices[0]
    assert len(choice.logprobs.token_logprobs) == len(whole) and choice.text == tokenizer.decode(whole)
    by_id = choice.model_extra["prompt_logprobs"]
    assert by_id[0] is None and len(by_id) == len(whole)
    entry = by_id[-1][str(whole[-1])]
    assert abs(entry["logprob"] - float(expected[-1])) < 1e-4 and entry["rank"] >= 1
    assert sorted(item["rank"] for item in by_id[-1].values())[0] == 1


def test_echo_refusals_are_named(server):
    import openai

    live, _, _ = server
    client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="echo with stream is not supported"):
        client.completions.create(model="tiny", prompt="hello", echo=True, stream=True)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs must be in"):
        client.completions.create(model="tiny", prompt="hello", extra_body={"prompt_logprobs": 50})
