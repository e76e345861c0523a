"""Tiny random models built from configs (no download), and the embedded SmolLM2 when wanted."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tests.kvzap_helpers import kvzap_surrogate  # noqa: F401  (a fixture for modules that run every policy)

VOCAB = 128
SHARED = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def _build(config_cls, model_cls, **extra):
    torch.manual_seed(0)
    model = model_cls(config_cls(**SHARED, **extra)).eval()
    return model


TINY_MODELS = {
    "llama": lambda: _build(LlamaConfig, LlamaForCausalLM),
    "qwen2": lambda: _build(Qwen2Config, Qwen2ForCausalLM, use_sliding_window=False),
    "mistral": lambda: _build(MistralConfig, MistralForCausalLM, sliding_window=None, head_dim=16),
}


@pytest.fixture(params=sorted(TINY_MODELS))
def tiny_model(request):
    return TINY_MODELS[request.param]()


@pytest.fixture
def llama():
    return TINY_MODELS["llama"]()


@pytest.fixture
def gemma2():
    """Alternating sliding-window (window 8) and full-attention layers."""
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=8,
    )
    return Gemma2ForCausalLM(config).eval()


def random_ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


@pytest.fixture(scope="session")
def smollm():
    import kvwise

    return kvwise.load_model()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A throwaway redis-server for one test module (the Redis tier's tests)."""
    from tests.redis_servers import start_redis

    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()
