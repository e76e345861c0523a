"""A tiny random Llama with a character tokenizer, saved to a directory as a user's checkpoint is, so
`kvwise serve --model DIR` and an in-process server load the same weights; and the greedy answers
an engine without any tier gives, which every faulty run must reproduce."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.sampling import SamplingParams
from kvwise.models import load_model
from tests.base_model import character_tokenizer

MAX_POSITIONS = 512


def save_tiny_llama(directory: Path, max_positions: int = MAX_POSITIONS) -> Path:
    tokenizer = character_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # every sampled id decodes to a character (or a special token)
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def prompt_ids(seed: int, length: int) -> list[int]:
    """Token ids of printable characters (4 and up: no special token inside a prompt)."""
    rng = random.Random(seed)
    return [rng.randrange(4, 90) for _ in range(length)]


def greedy_texts(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """What a server with no tier and no fault answers to each prompt, alone, greedily."""
    model, tokenizer = load_model(str(model_dir), device="cpu")
    core = EngineCore(model, tokenizer, CacheConfig(block_size=4, num_blocks=256, prefix_caching=False))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    texts = []
    for prompt in prompts:
        request = core.make_request(prompt, params)
        core.add(request)
        while core.has_work:
            core.step()
        texts.append(request.completion.text)
    return texts
