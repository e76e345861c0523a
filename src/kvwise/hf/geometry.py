"""What a transformers model's KV looks like: one place for every user.

The shapes are read from the model itself, not from its config. One forward of a single token runs
with a recording attention function, which sees each layer's real key and value shapes and the
sliding window the model passes to it. Configs disagree on names (GPT-NeoX has no
`num_key_value_heads`, Gemma 3 sets `head_dim` apart from `hidden_size / heads`, Qwen2 switches
windows per layer type), while the tensors an attention layer receives cannot be wrong.

The same forward shows whether the model is attention-only: a layer that never calls the attention
function (a Mamba mixer, linear attention, a short convolution) holds state that a KV cache cannot
hold, so such a model is refused with the reason.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from kvwise.hf.attention import attention_implementation
from kvwise.util.fingerprint import weights_fingerprint

# model -> (layer -> its attention's KV shape and window), probed once per model object; weak, so
# the entry goes with the model
_ATTENTION_SHAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

PROBE_NAME = "kvwise_probe"
# Layer types that are softmax attention over a KV cache (transformers' `config.layer_types`).
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


class UnsupportedModelError(ValueError):
    """The model has layers a KV cache cannot serve; the message says which and why."""


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    model_id: str  # a fingerprint of the weights (util.fingerprint): part of every block key's namespace
    windows: tuple[int | None, ...] = ()  # per layer: the sliding window, None for full attention

    @property
    def full_layers(self) -> list[int]:
        """Layers that attend over the whole context: the ones a policy may compress."""
        return [layer for layer, window in enumerate(self.windows) if window is None]

    @property
    def sliding_layers(self) -> list[int]:
        return [layer for layer, window in enumerate(self.windows) if window is not None]

    @property
    def is_hybrid(self) -> bool:
        """Some layers slide and some attend to everything (Gemma 2/3, Cohere 2, Qwen2 hybrids)."""
        return bool(self.full_layers) and bool(self.sliding_layers)

    def kv_bytes(self, num_tokens: int, bytes_per_value: int) -> int:
        """What an uncompressed cache holds after `num_tokens`: every full layer holds them all, a
        sliding layer the last `window - 1` (what transformers' sliding-window cache keeps between
        forwards: the next query sees those and itself)."""
        per_token = 2 * self.num_kv_heads * self.head_dim * bytes_per_value
        held = sum(num_tokens if window is None else min(num_tokens, window - 1) for window in self.windows)
        return held * per_token


def kv_geometry(model) -> KVGeometry:
    """The model's KV shapes, probed once per model object and remembered (the dtype is read each time)."""
    config = model.config.get_text_config(decoder=True)
    seen = _ATTENTION_SHAPES.get(model)
    if seen is None:
        check_attention_only(model, config)
        seen = _probe_attention(model)
    layers = config.num_hidden_layers
    missing = [layer for layer in range(layers) if layer not in seen]
    if missing:
        raise UnsupportedModelError(
            f"{type(model).__name__}: layers {missing} of {layers} never call an attention function, so their "
            "state is not a KV cache (recurrent, convolutional or shared layers); kvwise serves attention-only models"
        )
    shapes = {(heads, dim) for heads, dim, _ in seen.values()}
    if len(shapes) != 1:
        raise UnsupportedModelError(
            f"{type(model).__name__}: layers differ in KV heads or head size {sorted(shapes)}; "
            "kvwise's paged pool holds one shape for every layer"
        )
    ((num_kv_heads, head_dim),) = shapes
    model_id = weights_fingerprint(model)  # names the KV on every tier: the weights, not the path
    dtype = next(model.parameters()).dtype
    windows = tuple(seen[layer][2] for layer in range(layers))
    _ATTENTION_SHAPES[model] = seen
    return KVGeometry(layers, num_kv_heads, head_dim, dtype, model_id, windows)


def check_attention_only(model, config) -> None:
    """Refuse, with the reason, a model whose config declares layers other than softmax attention."""
    declared = list(getattr(config, "layer_types", None) or [])
    declared += list(getattr(config, "layers_block_type", None) or [])  # Jamba and Granite hybrids
    other = sorted({str(kind) for kind in declared} - ATTENTION_LAYER_TYPES - {"attention"})
    if other:
        raise UnsupportedModelError(
            f"{type(model).__name__} has layers of type {other}: only softmax attention keeps its state as "
            "keys and values, which is what kvwise compresses, pages and shares; this model is not supported"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{type(model).__name__} is an encoder-decoder model; kvwise serves decoders")


def _probe_attention(model) -> dict[int, tuple[int, int, int | None]]:
    """{layer_idx: (kv_heads, head_dim, sliding_window)} from one forward of one token."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    seen: dict[int, tuple[int, int, int | None]] = {}

    def record(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = getattr(module, "layer_idx", None)
        if layer is not None:
            seen[int(layer)] = (key.shape[1], key.shape[3], kwargs.get("sliding_window") or None)
        # query: [batch, heads, q, dim] -> output [batch, q, heads, value_dim]
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None

    AttentionInterface.register(PROBE_NAME, record)
    AttentionMaskInterface.register(PROBE_NAME, lambda *args, **kwargs: None)
    previous = attention_implementation(model)
    model.set_attn_implementation(PROBE_NAME)
    try:
        with torch.no_grad():
            token = torch.zeros((1, 1), dtype=torch.long, device=model.device)
            model(input_ids=token, use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
    return seen


def paged_storage_for(model, num_blocks: int, block_size: int):
    """A PagedKVStorage shaped for `model`, on its device, in its dtype."""
    from kvwise.kv.paged import PagedKVStorage

    shape = kv_geometry(model)
    return PagedKVStorage(
        shape.num_layers, num_blocks, block_size, shape.num_kv_heads, shape.head_dim, shape.dtype, model.device
    )
