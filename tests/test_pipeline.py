"""`pipeline("kvwise-text-generation")` as a kvpress user calls it, on the embedded SmolLM2: the
context compressed once, each question answered from its own copy; and the attention switch that a
KVWiseCache makes, undone by `restore_attention`."""

from __future__ import annotations

import pytest
from transformers import pipeline

import kvwise  # noqa: F401 - registers the task
from kvwise import KVWiseCache

pytestmark = [pytest.mark.smollm, pytest.mark.timeout(600)]

CONTEXT = (
    "The lighthouse keeper wrote in his log every evening. On the first night of winter he noted that the "
    "access code for the boathouse is 4821. The next morning the sea was calm and the gulls were quiet. "
) * 3


@pytest.fixture
def pipe(smollm):
    model, tokenizer = smollm
    yield pipeline("kvwise-text-generation", model=model, tokenizer=tokenizer, policy="snapkv", compression_ratio=0.5)
    model.set_attn_implementation("kvwise")


def test_one_question_and_many_from_one_compression(pipe):
    question = "What is the access code for the boathouse?"
    single = pipe(CONTEXT, question=question, max_new_tokens=20)
    assert "4821" in single["answer"]
    many = pipe(CONTEXT, questions=[question, "How was the sea the next morning?"], max_new_tokens=20)
    assert many["answers"][0] == single["answer"]  # a copy of the compressed context per question
    assert "calm" in many["answers"][1].lower()
    full = pipe(CONTEXT, question=question, max_new_tokens=20, policy="full", compression_ratio=0.0)
    assert "4821" in full["answer"]
    with pytest.raises(ValueError, match="question= or questions="):
        pipe(CONTEXT, question=question, questions=[question])


def test_the_attention_switch_is_reversible(smollm):
    model, _ = smollm
    model.set_attn_implementation("sdpa")
    cache = KVWiseCache(model, "snapkv", compression_ratio=0.5)
    assert model.config._attn_implementation == "kvwise" and cache.previous_attention == "sdpa"
    cache.restore_attention()
    assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("kvwise")
