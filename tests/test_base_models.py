"""A base model without a chat template, that needs its BOS (Gemma-style), used as a user would:
from a directory, through `kvwise.LLM`, `kvwise serve` with the `openai` client, the NIAH prompt
builder, the compressed-context store and `kvwise check-model`."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvwise
from kvwise.bench.haystack import NeedlePromptBuilder, NeedleTrial
from kvwise.hf.chat_template import NoChatTemplateError
from kvwise.hf.compressed_contexts import CompressedContexts
from kvwise.model_check import model_greedy
from kvwise.tiers.host import HostTier
from tests.base_model import CHAT_TEMPLATE, save_base_model
from tests.live_server import LiveServer

PROMPT = "Once upon a time, in a small village, there lived"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_base_model(tmp_path_factory.mktemp("base-model"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return kvwise.LLM(str(model_dir), device="cpu")


def test_text_prompts_get_the_bos_the_model_was_trained_with(llm, model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected_ids = tokenizer(PROMPT).input_ids
    assert expected_ids[0] == tokenizer.bos_token_id
    output = llm.generate(PROMPT, kvwise.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert output[0].prompt_token_ids == expected_ids
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert output[0].outputs[0].token_ids == model_greedy(model, expected_ids, 8)


def test_chat_without_a_template_is_refused_and_works_with_one(llm, tmp_path):
    messages = [{"role": "user", "content": "Hello"}]
    with pytest.raises(NoChatTemplateError, match="this model has no chat template"):
        llm.chat(messages, use_tqdm=False)
    template_file = tmp_path / "template.jinja"
    template_file.write_text(CHAT_TEMPLATE)
    params = kvwise.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for template in (CHAT_TEMPLATE, str(template_file)):
        output = llm.chat(messages, params, use_tqdm=False, chat_template=template)
        ids = output[0].prompt_token_ids
        assert ids[0] == 1 and ids[1] != 1  # the template's BOS, not a second one from the tokenizer
        assert llm.tokenizer.decode(ids[1:]) == "<user>Hello\n<assistant>"


def test_niah_uses_a_plain_prompt_with_the_bos(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    builder = NeedlePromptBuilder(tokenizer, "abc def ghi " * 40, "\nThe number is {key}.\n", "\nWhat?", "It is")
    prompt = builder.build(NeedleTrial(length=200, depth=0.5, trial=0, key=12345))
    assert not builder.uses_chat_template and "plain prompt" in builder.prompt_format
    context = prompt.context_ids[0].tolist()
    assert context[0] == tokenizer.bos_token_id and "The number is 12345." in tokenizer.decode(context[1:])
    assert tokenizer.decode(prompt.question_ids[0]) == "\nWhat?\nIt is"


def test_compressed_contexts_of_a_hybrid_model_round_trip(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    context = torch.tensor([[1] + list(range(10, 70))])  # 61 tokens, past the window of 16
    question = torch.tensor([[20, 21, 22]])
    contexts = CompressedContexts(HostTier(64 << 20))
    outputs = []
    for _ in range(2):
        cache = contexts.get_or_compress(model, context, "snapkv", 0.5)
        with torch.no_grad():
            ids = model.generate(torch.cat([context, question], 1), cache=cache, max_new_tokens=5, do_sample=False)
        outputs.append(ids[0, -5:].tolist())
    assert (contexts.misses, contexts.hits) == (1, 1)
    assert outputs[0] == outputs[1]  # the stored windows and full layers continue exactly as computed


def test_server_answers_completions_and_refuses_chat_without_a_template(model_dir, tmp_path):
    server = LiveServer("--model", str(model_dir), "--device", "cpu")
    try:
        api = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        completion = api.completions.create(model=model_dir.name, prompt=PROMPT, max_tokens=5, temperature=0)
        assert completion.usage.prompt_tokens == len(PROMPT) + 1  # one token per character, and the BOS
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(model=model_dir.name, messages=[{"role": "user", "content": "Hi"}])
        assert refused.value.status_code == 400
        expected = "this model has no chat template; use /v1/completions or start the server with --chat-template"
        assert refused.value.body["message"] == expected
    finally:
        assert server.stop() == 0
    template_file = tmp_path / "template.jinja"
    template_file.write_text(CHAT_TEMPLATE)
    server = LiveServer("--model", str(model_dir), "--device", "cpu", "--chat-template", str(template_file))
    try:
        api = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        chat = api.chat.completions.create(
            model=model_dir.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert chat.usage.prompt_tokens == len("<user>Hi\n<assistant>") + 1
    finally:
        assert server.stop() == 0


def test_check_model_prints_a_verdict_per_check(model_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    command = [sys.executable, "-m", "kvwise.cli", "check-model", str(model_dir), "--text-file", str(text)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(lines) == 6 and all(line.startswith("PASS") for line in lines)
    assert "5 sliding-window" in result.stdout and "verdict: supported" in result.stdout


def test_bench_niah_runs_on_a_base_model_with_a_plain_prompt(model_dir, tmp_path):
    from kvwise.bench.niah import NiahConfig, run_niah

    config = NiahConfig(
        policies=["full", "snapkv"], ratios=[0.5], lengths=[120], depths=[0.5], trials_per_depth=1, model=str(model_dir)
    )
    report = run_niah(config, tmp_path)
    assert "plain prompt" in report["prompt_format"] and len(report["results"]) == 2
    assert "prompt=plain prompt (the tokenizer has no chat template)" in (tmp_path / "niah.md").read_text()
