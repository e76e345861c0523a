"""The offline `LLM` API on the embedded SmolLM2: greedy equals transformers, sampling options work."""

from __future__ import annotations

import pytest
import torch

from kvwise import LLM, CacheConfig, SamplingParams

pytestmark = pytest.mark.smollm


@pytest.fixture
def llm(smollm):
    model, tokenizer = smollm
    engine = LLM(model, CacheConfig(block_size=16, num_blocks=256, token_budget=128), tokenizer=tokenizer)
    yield engine
    model.set_attn_implementation("kvwise")  # the session's model goes back to the cache's attention


def test_greedy_batch_matches_generate(llm, smollm):
    model, tokenizer = smollm
    prompts = ["The capital of France is", "Write one word about the sea:", "1, 2, 3, 4,"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    model.set_attn_implementation("sdpa")
    for prompt, output in zip(prompts, outputs):
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1] :].tolist()
        assert output.outputs[0].token_ids == expected
        assert output.outputs[0].finish_reason == "length"


def test_n_seeds_logprobs_and_stop(llm):
    params = SamplingParams(temperature=0.9, max_tokens=8, n=2, seed=5, logprobs=2)
    first = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    again = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert len(first.outputs) == 2 and [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert all(len(o.logprobs) == len(o.token_ids) for o in first.outputs if o.finish_reason == "length")
    stopped = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20, stop=[","]), use_tqdm=False)
    assert stopped[0].outputs[0].finish_reason == "stop" and "," not in stopped[0].outputs[0].text


def test_prompt_longer_than_the_context(llm):
    with pytest.raises(ValueError, match="maximum context is 8192"):
        llm.generate([[1] * 8190], SamplingParams(max_tokens=10), use_tqdm=False)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_mixed_lengths_equal_generate_with_reuse_on_and_off(smollm, prefix_caching):
    model, tokenizer = smollm
    config = CacheConfig(block_size=16, num_blocks=256, token_budget=96, prefix_caching=prefix_caching)
    engine = LLM(model, config, tokenizer=tokenizer)
    shared = "You are a careful assistant who answers in one short sentence. " * 4
    prompts = [shared + "What is the capital of Italy?", shared + "Name a colour.", "Two plus two is", shared]
    params = SamplingParams(temperature=0, max_tokens=8)
    try:
        first = engine.generate(prompts, params, use_tqdm=False)
        second = engine.generate(prompts, params, use_tqdm=False)  # with reuse on, the prompts are cached now
    finally:
        model.set_attn_implementation("sdpa")
    for prompt, one, two in zip(prompts, first, second):
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
        if expected[-1] == tokenizer.eos_token_id:  # the engine reports text tokens, not the EOS that ended them
            expected = expected[:-1]
        assert one.outputs[0].token_ids == two.outputs[0].token_ids == expected
    reused = sum(request.reused for output in second for request in output.requests)
    assert (reused > 0) == prefix_caching
    model.set_attn_implementation("kvwise")


def test_stop_token_ids_and_penalties(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = llm.generate("1, 2, 3, 4,", greedy, use_tqdm=False)[0].outputs[0]
    third = plain.token_ids[2]
    stop = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[third])
    stopped = llm.generate("1, 2, 3, 4,", stop, use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == plain.token_ids[: plain.token_ids.index(third)]  # the stop token is not returned
    # counting up repeats ", ": a frequency penalty breaks the pattern, the greedy path follows it
    penalized = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=2.0)
    assert llm.generate("1, 2, 3, 4,", penalized, use_tqdm=False)[0].outputs[0].token_ids != plain.token_ids


def test_vllm_style_options_per_prompt_params_and_outputs(smollm):
    model, tokenizer = smollm
    llm = LLM(model, tokenizer=tokenizer, max_model_len=128, enable_prefix_caching=True, num_blocks=64, block_size=16)
    try:
        assert llm.cache_config.num_blocks == 64 and llm.cache_config.prefix_caching
        with pytest.raises(ValueError, match="maximum context is 128"):
            llm.generate("hello " * 120, SamplingParams(max_tokens=30), use_tqdm=False)
        prompt = "Paris is the capital of France, a city of art, food and long walks by the river. " * 3
        params = [SamplingParams(temperature=0, max_tokens=2), SamplingParams(temperature=0, max_tokens=5)]
        first, second = llm.generate([prompt, prompt + " Paris"], params, use_tqdm=False)
        assert [len(first.outputs[0].token_ids), len(second.outputs[0].token_ids)] == [2, 5]
        assert first.finished and second.finished
        again = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
        assert again.num_cached_tokens >= 32 and first.num_cached_tokens == 0
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
            llm.generate([prompt, prompt], [SamplingParams()], use_tqdm=False)
        with pytest.raises(TypeError, match="unknown arguments"):
            LLM(model, tokenizer=tokenizer, num_block=3)
        if model.device.type == "cpu":
            with pytest.raises(ValueError, match="gpu_memory_utilization sizes a CUDA device"):
                LLM(model, tokenizer=tokenizer, gpu_memory_utilization=0.5)
    finally:
        model.set_attn_implementation("kvwise")
