"""`KVWiseCache`: a transformers `Cache` that evicts and quantizes KV per head, and reports it."""

from __future__ import annotations

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs

from kvwise.hf.attention import ATTENTION_NAME, use_kvwise_attention
from kvwise.hf.attention_inputs import install_attention_input_hooks
from kvwise.hf.geometry import kv_geometry
from kvwise.hf.layer import CompressingLayer
from kvwise.hf.rope import query_rotator
from kvwise.kv.quantizer import Quantizer, make_quantizer
from kvwise.kv.stored_form import StoredForm, fill_pages
from kvwise.policies import selection
from kvwise.policies.base import Policy
from kvwise.policies.mix import Mix, parse_mix
from kvwise.policies.registry import make_policy
from kvwise.policies.scoring_input import ScoringInput


def full_kv_bytes(model, num_tokens: int, bytes_per_value: int) -> int:
    """What an uncompressed cache holds for `num_tokens`: keys and values of every layer, a
    sliding-window layer at most its window."""
    return kv_geometry(model).kv_bytes(num_tokens, bytes_per_value)


class KVWiseCache(Cache):
    """A KV cache that compresses at prefill, optionally holds a decode budget, and may quantize.

    Usage, query-aware (the whole prompt is compressed at its prefill):

        cache = KVWiseCache(model, policy="snapkv", compression_ratio=0.9)
        model.generate(input_ids, cache=cache, max_new_tokens=32)

    Query-agnostic ("compress a document once"): `cache.compress_context(context_ids)`, then
    `model.generate(context_and_question_ids, cache=cache)`; only the new tokens are computed.

    Evict, then quantize: `KVWiseCache(model, "snapkv", 0.75, quant="kivi4")`. The policy picks
    the tokens and the quantizer stores them; the newest tokens stay in a full-precision residual
    window, except after `compress_context`, which quantizes the whole (frozen) context.

    Args:
        model: the transformers model the cache serves; it is switched to kvwise attention.
        policy: a registered policy name, or a `Policy` instance.
        compression_ratio: fraction of the prefilled context's KV entries removed, in [0, 1).
            Counted over all full-attention layers and heads together.
        max_kv_tokens: if set, each head keeps at most this many tokens while generating.
        tokenizer: needed only by policies that build a prompt of their own (KVzip).
        quant: a quantizer name ("kivi2", "kivi4", "int8", "fp8"), a `Quantizer` from
            `kvwise.make_quantizer(name, **options)`, or None for full precision. It applies to
            full-attention layers; sliding-window layers keep transformers' own window.
        error_probe_every: the attention-output error of quantization is probed on the first
            and then every n-th step of a layer that quantizes tokens (see `stats()`).
        policy_kwargs: hyperparameters of the policy's dataclass.
    """

    def __init__(
        self,
        model,
        policy: str | Policy = "full",
        compression_ratio: float = 0.0,
        max_kv_tokens: int | None = None,
        tokenizer=None,
        quant: str | Quantizer | None = None,
        error_probe_every: int = 4,
        **policy_kwargs,
    ):
        self.compression_ratio = selection.check_ratio(compression_ratio)
        self.quantizer = make_quantizer(quant)
        if self.quantizer is not None:
            self.quantizer = self.quantizer.attach(model)  # a low-rank codec takes the model's bases
        if int(error_probe_every) < 1:
            raise ValueError(f"error_probe_every must be a positive integer, got {error_probe_every}")
        self.error_probe_every = int(error_probe_every)
        self.quantization_deferred = False
        self.max_kv_tokens = selection.check_max_kv_tokens(max_kv_tokens)
        self.policy = make_policy(policy, **policy_kwargs) if isinstance(policy, str) else policy
        self.policy.attach(model)
        # the layers' attention inputs reach a policy that scores hidden states (kvzap) only
        self.wants_attention_inputs = self.policy.needs_hidden_states
        if self.wants_attention_inputs:
            install_attention_input_hooks(model)
        self.model = model
        self.tokenizer = tokenizer
        self.in_context_pass = False
        self.rotate_queries = query_rotator(model)
        self.compress_on_first_fill = True
        kv_geometry(model)  # refuses models with layers that are not softmax attention, naming them
        config = model.config.get_text_config(decoder=True)
        self.max_positions = getattr(config, "max_position_embeddings", None)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
        layers = []
        for layer_idx, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
            if layer_type == "full_attention":
                layers.append(CompressingLayer(layer_idx, self))
            elif layer_type in DYNAMIC_LAYER_TYPE_MAPPING:
                # Sliding-window layers keep transformers' own window semantics; budgets apply
                # to full-attention layers only.
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[layer_type](**kwargs))
            else:
                raise ValueError(f"layer type {layer_type!r} of layer {layer_idx} is not supported by KVWiseCache")
        super().__init__(layers=layers)
        self.compressing_layers = [layer for layer in layers if isinstance(layer, CompressingLayer)]
        self._layer_rank = {id(layer): rank for rank, layer in enumerate(self.compressing_layers)}
        # kvwise attention reads per-head lengths and masks; the model's own attention does not
        self.previous_attention = use_kvwise_attention(model)

    @classmethod
    def for_mix(cls, model, mix: str | Mix, tokenizer=None, **kwargs) -> KVWiseCache:
        """The library cache of a KV mix ("kvzip@0.9+kivi4", or a `Mix`): the same spec the
        engine resolves, so both paths read one syntax."""
        mix = parse_mix(mix)
        budgets = dict(compression_ratio=mix.ratio, max_kv_tokens=mix.max_tokens, quant=mix.quant)
        return cls(model, mix.policy, tokenizer=tokenizer, **budgets, **mix.options_dict(), **kwargs)

    def store_attention_input(self, layer_idx: int, hidden_states: torch.Tensor) -> None:
        """hidden_states [batch, query_len, hidden]: layer `layer_idx`'s input in this forward."""
        self.layers[layer_idx].attention_input = hidden_states

    def restore_attention(self) -> None:
        """Switch the model back to the attention implementation it had before this cache (eager,
        sdpa, ...). Another KVWiseCache, or one in use, needs kvwise attention again."""
        if self.previous_attention not in (None, ATTENTION_NAME):
            self.model.set_attn_implementation(self.previous_attention)

    @classmethod
    def from_preset(cls, model, name: str, tokenizer=None, **overrides) -> KVWiseCache:
        """A cache from a named preset (see `kvwise.presets.PRESETS`); keyword arguments override it."""
        from kvwise.presets import preset

        settings = {**preset(name).as_kwargs(), **overrides}
        return cls(model, tokenizer=tokenizer, **settings)

    # ---- decisions the layers ask for -----------------------------------------------------------
    @property
    def num_compressing_layers(self) -> int:
        return len(self.compressing_layers)

    def should_compress(self, layer: CompressingLayer, prefix_len: int) -> bool:
        """Compress at the first fill of a layer, unless the policy keeps everything or waits for a pass."""
        return (
            prefix_len == 0
            and self.compress_on_first_fill
            and self.compression_ratio > 0
            and not self.policy.keeps_everything
            and not self.policy.needs_context_pass
        )

    def head_budgets(self, layer: CompressingLayer, valid: torch.Tensor) -> torch.Tensor:
        """Tokens per head for `layer` at prefill: [batch] int64. The total over layers is exact."""
        num_valid = valid[:, 0].sum(dim=-1).tolist()  # every head sees the same prefill tokens
        rank, num_layers = self._layer_rank[id(layer)], len(self.compressing_layers)
        budgets = selection.head_budgets(self.policy, self.compression_ratio, num_valid, rank, num_layers)
        return torch.tensor(budgets, device=valid.device)

    def select_for_layer(self, layer: CompressingLayer, scoring: ScoringInput) -> torch.Tensor:
        """Keep mask [batch, num_kv_heads, seq_len] for a layer's prefill."""
        budgets = self.head_budgets(layer, scoring.valid)
        scoring.budget, scoring.row_budgets = int(budgets.max()), budgets
        if self.policy.budget_scope == "global":
            layer.context_scores = self.policy.score(scoring).float()
            return scoring.valid
        scores = self.policy.score(scoring)
        keep = selection.select_in_layer(self.policy, scores, scoring, budgets)
        return self._fill_pages(keep, scores, scoring.valid)

    def _fill_pages(self, keep: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """keep, scores, valid: [..., seq_len]. A quantized mix keeps whole pages of its stored form
        after each head's sinks (`fill_pages`), as the engine's pages hold them."""
        if self.quantizer is None:
            return keep
        form = StoredForm.of(self.quantizer)
        return fill_pages(keep, scores, valid, form.page_tokens(), form.sink_tokens)

    def decode_scores(self, scoring: ScoringInput) -> torch.Tensor:
        scoring.budget = self.max_kv_tokens
        return self.policy.score(scoring)

    def layer_compressed(self, layer: CompressingLayer) -> None:
        """Called after each layer's prefill; a global budget is settled after the last layer."""
        if self.policy.budget_scope == "global" and layer is self.compressing_layers[-1]:
            self.finalize_global_selection()

    def finalize_global_selection(self) -> None:
        """Select over every layer and head at once from the scores the layers stashed."""
        layers = self.compressing_layers
        if any(layer.context_scores is None for layer in layers):
            raise RuntimeError("global selection needs scores from every compressing layer")
        valid = torch.stack([layer.padded()[2] for layer in layers], dim=1)  # [batch, layers, heads, seq]
        scores = torch.stack([layer.context_scores for layer in layers], dim=1)
        keep = selection.select_across_layers(self.policy, self.compression_ratio, scores, valid)
        keep = self._fill_pages(keep, scores, valid)
        for index, layer in enumerate(layers):
            layer.apply_keep(keep[:, index])
            layer.context_scores = None

    # ---- the query-agnostic API -----------------------------------------------------------------
    @torch.no_grad()
    def compress_context(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Prefill `input_ids` [batch, seq_len] into this empty cache and compress it.

        Given a context alone, this is query-agnostic compression ("compress once, ask many");
        continue with `model.generate(torch.cat([input_ids, question_ids], 1), cache=cache)`.
        Given a whole prompt but its last token, it is query-aware compression for policies such
        as KVzip that need a pass of their own. `attention_mask` [batch, seq_len] marks left padding.
        With a quantizer, the kept context is quantized whole once the selection is final.
        """
        if self.get_seq_length() > 0:
            raise ValueError("compress_context needs an empty cache; call cache.reset() first")
        self.check_length(input_ids.shape[1])
        # Evict first, then quantize what is kept: nothing is quantized until the selection is final.
        self.quantization_deferred = True
        try:
            self.model(input_ids=input_ids, attention_mask=attention_mask, cache=self, use_cache=True, logits_to_keep=1)
            if self.policy.needs_context_pass and self.compression_ratio > 0 and self.compressing_layers:
                # The pass only scores: sliding-window layers would otherwise end up holding the
                # window of the repeated text, and count its tokens in their length.
                others = [layer for layer in self.layers if not isinstance(layer, CompressingLayer)]
                untouched = [(layer, dict(layer.__dict__)) for layer in others]
                self.in_context_pass = True
                try:
                    passes = self.policy.context_passes(input_ids, attention_mask, self.tokenizer)
                    for pass_ids, pass_mask in passes:  # scores: the highest over the passes
                        self.model(
                            input_ids=pass_ids, attention_mask=pass_mask, cache=self, use_cache=True, logits_to_keep=1
                        )
                finally:
                    self.in_context_pass = False
                    for layer, state in untouched:
                        layer.__dict__.update(state)
                self.finalize_global_selection()
        finally:
            self.quantization_deferred = False
        for layer in self.compressing_layers:
            layer.flush()

    def check_length(self, num_tokens: int) -> None:
        if self.max_positions is not None and num_tokens > self.max_positions:
            raise ValueError(f"the context has {num_tokens} tokens but the model's maximum is {self.max_positions}")

    # ---- reports ---------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes the cache's tensors really hold, over every layer."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, CompressingLayer):
                total += layer.nbytes()
            elif getattr(layer, "is_initialized", False):
                total += layer.keys.nbytes + layer.values.nbytes
        return total

    def kept_tokens(self) -> dict[int, torch.Tensor]:
        """Kept tokens per head for each full-attention layer: layer_idx -> [batch, num_kv_heads]."""
        return {layer.layer_idx: layer.kept_tokens() for layer in self.compressing_layers if layer.is_initialized}

    def stats(self) -> dict:
        """Memory and quality signals: bytes, kept and quantized tokens, quantization errors.

        Per full-attention layer: the relative L2 reconstruction error of keys and values over
        everything quantized so far, and the relative error of the attention output on the most
        recent step that quantized tokens (see `kvwise.hf.quant_probe`). Totals pool the layers.
        """
        layers, tallies = [], []
        for layer in self.compressing_layers:
            if not layer.is_initialized:
                continue
            store = layer.store
            key_error, value_error = store.errors.relative()
            tallies.append(store.errors)
            layers.append(
                {
                    "layer": layer.layer_idx,
                    "bytes": layer.nbytes(),
                    "kept_tokens": int(store.lengths.sum()),
                    "quantized_tokens": int(store.quantized_lengths.sum()),
                    "residual_tokens": int(store.residual_lengths.sum()),
                    "key_relative_error": key_error,
                    "value_relative_error": value_error,
                    "attention_relative_error": layer.attention_error,
                }
            )
        probes = [entry["attention_relative_error"] for entry in layers]
        probes = [probe for probe in probes if probe is not None]
        key_norm = sum(tally.key_norm for tally in tallies)
        value_norm = sum(tally.value_norm for tally in tallies)
        return {
            "policy": self.policy.name,
            "compression_ratio": self.compression_ratio,
            "quantizer": None if self.quantizer is None else self.quantizer.name,
            "bytes": self.nbytes(),
            "key_relative_error": (sum(t.key_error for t in tallies) / key_norm) ** 0.5 if key_norm else None,
            "value_relative_error": (sum(t.value_error for t in tallies) / value_norm) ** 0.5 if value_norm else None,
            "attention_relative_error": sum(probes) / len(probes) if probes else None,
            "layers": layers,
        }

    def bytes_read_last_step(self) -> int:
        """KV bytes the last forward read from the full-attention layers (Quest reads fewer)."""
        return sum(layer.bytes_read_last_step for layer in self.compressing_layers)
