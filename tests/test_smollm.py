"""A few checks on the real embedded model (SmolLM2-135M-Instruct)."""

import pytest
import torch
from transformers import DynamicCache

import kvwise
from kvwise.bench.haystack import (
    DEFAULT_ANSWER_PREFIX,
    DEFAULT_NEEDLE,
    DEFAULT_QUESTION,
    NeedlePromptBuilder,
    read_haystack,
    trial_grid,
)
from kvwise.bench.niah import run_trial

pytestmark = pytest.mark.smollm


def test_reload_reads_the_converted_weights_not_the_gguf(smollm, monkeypatch):
    """A reload skips the ~25 s GGUF dequantization: it never opens the GGUF (a check of the path
    taken, where a wall-clock bound would flake on a loaded machine)."""
    import kvwise.models

    def no_gguf():
        raise AssertionError("the reload went back to the GGUF file")

    monkeypatch.setattr(kvwise.models, "_embedded_gguf_path", no_gguf)
    model, _ = kvwise.load_model()
    assert model.config.num_hidden_layers == smollm[0].config.num_hidden_layers


def test_full_matches_dynamic_cache_on_smollm(smollm):
    model, tokenizer = smollm
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 8, return_tensors="pt").input_ids
    with torch.no_grad():
        reference = model(ids, cache=DynamicCache(config=model.config), use_cache=True).logits
        ours = model(ids, cache=kvwise.KVWiseCache(model, "full"), use_cache=True).logits
    assert torch.allclose(reference, ours, atol=1e-4)


@pytest.fixture(scope="module")
def needle_prompt(smollm):
    _, tokenizer = smollm
    builder = NeedlePromptBuilder(tokenizer, read_haystack(), DEFAULT_NEEDLE, DEFAULT_QUESTION, DEFAULT_ANSWER_PREFIX)
    trial = trial_grid([1000], [0.5], 1, seed=123)[0]
    return trial, builder.build(trial)


def test_full_cache_finds_the_needle(smollm, needle_prompt):
    model, tokenizer = smollm
    trial, prompt = needle_prompt
    row = run_trial(model, tokenizer, prompt, "full", 0.0, "agnostic")
    assert str(trial.key) in row["answer"]


def test_kvzip_keeps_the_needle_in_a_tenth_of_the_memory(smollm, needle_prompt):
    model, tokenizer = smollm
    trial, prompt = needle_prompt
    row = run_trial(model, tokenizer, prompt, "kvzip", 0.9, "agnostic")
    assert str(trial.key) in row["answer"]
    assert row["kv_bytes"] <= 0.11 * row["full_kv_bytes"]


def test_cli_generate_reports_bytes(capsys):
    from kvwise.cli import main

    assert (
        main(["generate", "--prompt", "Name a color.", "--policy", "snapkv", "--ratio", "0.5", "--max-new-tokens", "4"])
        == 0
    )
    err = capsys.readouterr().err
    assert "kv_bytes_before=" in err and "kv_bytes_after=" in err


def test_prefix_reuse_keeps_greedy_tokens_on_smollm(smollm):
    from kvwise.hf.prefix_reuse import PrefixReuse

    model, tokenizer = smollm
    essay = read_haystack()[:3000]
    reuse = PrefixReuse(model, tenant="test", block_size=16, device_blocks=128)
    for question in ("Who wrote this?", "What is the main point?"):
        ids = tokenizer(essay + "\n\n" + question, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=12, do_sample=False)
        assert torch.equal(reuse.generate(ids, max_new_tokens=12, do_sample=False), expected)
    assert reuse.stats.hits_tokens["device"] > 500  # the second prompt reused the essay
