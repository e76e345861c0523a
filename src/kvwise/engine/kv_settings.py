"""`KVSettings`: a request's own KV policy, applied to its private blocks only.

    llm.generate(prompts, params, kv="snapkv@0.5,max=256")     # or kv=Mix("snapkv", 0.5, 256)

A mix (`policies.mix.Mix`, the spec) becomes `KVSettings` in one place, `resolve`, at the
engine's edge: the policy object that scores (`scorer`) and the quantizer that stores
(`quantizer`) are built there once, with the engine's own checks, and every later reader (the
manager, its pools, the runner) uses those objects, never the names again.

- `policy` + `ratio`: when the prompt's prefill ends (or, query-agnostic, once the request's
  `compress_upto` leading tokens are computed), the policy scores the request's private tokens
  (everything after the prefix it reused from the cache) and keeps (1 - ratio) of them, with the
  library path's budgets: the same number per head, per-layer weights (PyramidKV), shared by the
  heads of a layer (Ada-KV) or by every head of every layer (KVzip, after its reconstruction
  pass). Each (layer, KV head) keeps its own tokens in head pages; the blocks they came from go
  back to the pool, zeroed.
- `max_tokens`: whenever a head's private tokens exceed it by a block, the policy evicts down
  to it again (H2O and Scissorhands keep their running statistics per request meanwhile).
- `quest` + `ratio`: nothing is evicted; each decode step reads only the top (1 - ratio) pages of
  each KV head (and the newest), chosen by the query; the request counts the bytes it read.
- `quantizer` (kivi2, kivi4, int8, fp8): once the prefill is done, full private blocks outside the
  quantizer's residual window (and the first, sink block) are stored quantized (`QuantPool`).

Shared prefix blocks are never touched, and a request with settings never publishes its
private blocks to the prefix cache (they hold its compressed state, not the prompt's).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwise.kv.quantizer import Quantizer, make_quantizer
from kvwise.policies.base import Policy
from kvwise.policies.mix import Mix, parse_mix
from kvwise.policies.registry import make_policy


@dataclass(frozen=True, eq=False)
class KVSettings:
    """A mix resolved for the engine (made by `resolve`): the spec and the objects it names."""

    mix: Mix
    scorer: Policy  # scores tokens for eviction (or pages, for quest); "full" when nothing is evicted
    quantizer: Quantizer | None  # stores what is kept, or None for the model's dtype

    @property
    def policy(self) -> str:
        return self.mix.policy

    @property
    def ratio(self) -> float:
        return self.mix.ratio

    @property
    def max_tokens(self) -> int | None:
        return self.mix.max_tokens

    @property
    def quant(self) -> str | None:
        """The quantizer's canonical spec: it keys the quantizer's pool."""
        return self.mix.quant

    @property
    def options(self) -> dict:
        return dict(self.mix.options)

    @property
    def spec(self) -> str:
        return self.mix.spec

    @property
    def evicts(self) -> bool:
        return not self.scorer.keeps_everything and (self.ratio > 0 or self.max_tokens is not None)

    @property
    def selects_pages(self) -> bool:
        """Quest: nothing is evicted, and each decode step reads only the top pages per KV head."""
        return hasattr(self.scorer, "select_pages") and self.ratio > 0

    @property
    def active(self) -> bool:
        return self.evicts or self.quantizer is not None or self.selects_pages


def resolve(kv: str | Mix | KVSettings | None) -> KVSettings | None:
    """The engine's settings for a mix (a spec such as "kvzip@0.9+kivi4", a `Mix`, or settings
    already resolved); ValueError naming the fault. "full" resolves to settings that keep
    everything (`active` is False): asked for explicitly, it still wins over the adaptive
    controller. None stays None: the request asks for nothing."""
    if kv is None or isinstance(kv, KVSettings):
        return kv
    mix = parse_mix(kv)
    settings = KVSettings(mix, make_policy(mix.policy, **mix.options_dict()), make_quantizer(mix.quant))
    if getattr(settings.scorer, "pass_chunk", 0):
        raise ValueError(
            "kvzip's pass_chunk (chunked reconstruction) runs in the library cache (KVWiseCache); "
            "the engine re-reads the context in one pass"
        )
    return settings
