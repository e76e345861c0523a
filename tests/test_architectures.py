"""The supported model families: kvwise computes exactly what each model computes.

One tiny random model per family, built from its config (no download). Each keeps what makes its
family different; the comment says what that is. For every family (`kvwise.model_check`):

- engine: logits after every sampled step equal the model's own forward (relative error <= 1e-4,
  float32) and greedy tokens equal `model.generate`, for a batch of mixed-length prompts with
  chunked prefill crossing the sliding window, with prefix reuse on and off and the CPU decode
  kernel on and off;
- `KVWiseCache(policy="full")`: the model's own cache's logits, within 1e-5;
- ratio 0: after `compress_context`, the continuation equals the model's;
- budgets: every policy holds exactly its budget at the original positions on the full-attention
  layers, and sliding layers hold exactly the model's own window.

Families whose layers are not all softmax attention are refused with the reason.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from kvwise.hf.geometry import UnsupportedModelError, kv_geometry
from kvwise.model_check import check_budgets, check_engine, check_full_cache, check_ratio_zero
from kvwise.policies.registry import policy_names
from tests.conftest import SHARED

pytestmark = pytest.mark.usefixtures("kvzap_surrogate")  # kvzap runs on a random surrogate

VOCAB = 256  # a wider vocabulary than the other tests' tiny models: fewer near-tied logits
BASE = {**SHARED, "vocab_size": VOCAB}
WINDOW = 8  # shorter than the prompts, so chunked prefill and decoding cross it

FAMILIES = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    # every layer slides
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=WINDOW, head_dim=16)),
    # hybrid: the layers from max_window_layers on slide; biased q/k/v
    "qwen2": (
        tf.Qwen2Config,
        tf.Qwen2ForCausalLM,
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    # q/k RMSNorm before RoPE
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=16)),
    # alternating window/full layers, soft-capped attention and final logits
    "gemma2": (
        tf.Gemma2Config,
        tf.Gemma2ForCausalLM,
        dict(num_hidden_layers=4, head_dim=16, sliding_window=WINDOW),
    ),
    # the real shape: five sliding layers to one full, one KV head, head_dim 256, q/k norms,
    # a RoPE base per layer type, query_pre_attn_scalar, scaled embeddings
    "gemma3": (
        tf.Gemma3TextConfig,
        tf.Gemma3ForCausalLM,
        dict(
            num_hidden_layers=6,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=WINDOW,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
    ),
    # fused qkv and gate/up projections
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(pad_token_id=0)),
    # q/k norms over all heads, norms after attention and MLP
    "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, {}),
    # hybrid window/full layers, parallel attention and MLP, interleaved RoPE, logit scale
    "cohere2": (tf.Cohere2Config, tf.Cohere2ForCausalLM, dict(num_hidden_layers=4, sliding_window=WINDOW)),
    # embedding, attention, residual and logit multipliers
    "granite": (
        tf.GraniteConfig,
        tf.GraniteForCausalLM,
        dict(embedding_multiplier=2.0, attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=4.0),
    ),
    # partial rotary (a quarter of each head), LayerNorm
    "stablelm": (tf.StableLmConfig, tf.StableLmForCausalLM, dict(partial_rotary_factor=0.25)),
    # partial rotary, fused qkv, no GQA (no num_key_value_heads at all)
    "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, dict(rotary_pct=0.25)),
    # biased projections, LayerNorm, GELU MLP
    "starcoder2": (tf.Starcoder2Config, tf.Starcoder2ForCausalLM, dict(sliding_window=None)),
}


def build(family: str):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    return model_cls(config_cls(**{**BASE, **extra})).eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param, build(request.param)


def prompts(lengths, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=generator).tolist() for length in lengths]


MIXED = prompts((5, 13, 22))
# shares 12 and 20 tokens with MIXED's prompts: whole blocks past the window come from the cache
REUSING = [MIXED[1][:12] + prompts((3,), seed=2)[0], MIXED[2][:20] + prompts((6,), seed=3)[0]]


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["cpu-kernel", "sdpa"])
@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no-reuse"])
def test_engine_equals_the_model(family, reuse, cpu_kernel):
    name, model = family
    verdict = check_engine(model, [MIXED, REUSING], prefix_caching=reuse, cpu_kernel=cpu_kernel)
    assert verdict.passed, f"{name}: {verdict.detail}"
    assert (verdict.measures["reused"] >= 32) == reuse, verdict.detail


def test_full_cache_equals_the_model_cache(family):
    name, model = family
    verdict = check_full_cache(model, MIXED[2])
    assert verdict.passed, f"{name}: {verdict.detail}"


def test_ratio_zero_continuation_equals_the_model(family):
    name, model = family
    context, question = prompts((30, 5), seed=4)
    for policy in ("snapkv", "kvzip"):
        verdict = check_ratio_zero(model, context, question, policy)
        assert verdict.passed, f"{name}: {verdict.detail}"


@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_every_policy_keeps_its_budget_and_positions(family, ratio):
    name, model = family
    (context,) = prompts((40,), seed=5)
    failures = [check_budgets(model, context, policy, ratio) for policy in policy_names()]
    failures = [verdict.detail for verdict in failures if not verdict.passed]
    assert not failures, f"{name}: " + " | ".join(failures)


def test_hybrid_geometry_is_read_from_the_model():
    geometry = kv_geometry(build("gemma3"))
    assert geometry.windows == (WINDOW,) * 5 + (None,)
    assert (geometry.num_kv_heads, geometry.head_dim) == (1, 256)
    # the full layer holds every token, each sliding layer the last WINDOW - 1
    assert geometry.kv_bytes(100, 4) == (100 + 5 * (WINDOW - 1)) * 2 * 256 * 4
    assert kv_geometry(build("gpt_neox")).num_kv_heads == 4  # from the tensors, not a config default


# Layers that are not softmax attention keep state a KV cache cannot hold: refused, never served.
REFUSED = {
    "lfm2 (short convolutions)": lambda: tf.Lfm2ForCausalLM(
        tf.Lfm2Config(**{**BASE, "layer_types": ["conv", "full_attention", "conv"]})
    ),
    "jamba (Mamba layers)": lambda: tf.JambaForCausalLM(
        tf.JambaConfig(**BASE, attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False, num_experts=1)
    ),
    "mamba (no attention at all)": lambda: tf.MambaForCausalLM(
        tf.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, use_mambapy=False)
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_families_without_attention_are_refused_with_the_reason(name):
    import kvwise

    model = REFUSED[name]().eval()
    with pytest.raises(UnsupportedModelError, match="not supported|never call an attention|kvwise serves"):
        kv_geometry(model)
    with pytest.raises(UnsupportedModelError):
        kvwise.LLM(model)
    with pytest.raises(UnsupportedModelError):
        kvwise.KVWiseCache(model, "snapkv", 0.5)
