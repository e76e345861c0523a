"""`KVSettings`: a request's own KV policy, applied to its private blocks only.

    SamplingParams(...) plus KVSettings(policy="snapkv", ratio=0.5, max_kv_tokens=256)

- `policy` + `ratio`: when the prompt's prefill ends (or, query-agnostic, once the request's
  `compress_upto` leading tokens are computed), the policy scores the request's private tokens
  (everything after the prefix it reused from the cache) and keeps (1 - ratio) of them, with the
  library path's budgets: the same number per head, per-layer weights (PyramidKV), shared by the
  heads of a layer (Ada-KV) or by every head of every layer (KVzip, after its reconstruction
  pass). Each (layer, KV head) keeps its own tokens in head pages; the blocks they came from go
  back to the pool, zeroed.
- `max_kv_tokens`: whenever a head's private tokens exceed it by a block, the policy evicts down
  to it again (H2O and Scissorhands keep their running statistics per request meanwhile).
- `quest` + `ratio`: nothing is evicted; each decode step reads only the top (1 - ratio) pages of
  each KV head (and the newest), chosen by the query; the request counts the bytes it read.
- `quant` (kivi2, kivi4, int8, fp8): once the prefill is done, full private blocks outside the
  quantizer's residual window (and the first, sink block) are stored quantized (`QuantPool`).

Shared prefix blocks are never touched, and a request with settings never publishes its
private blocks to the prefix cache (they hold its compressed state, not the prompt's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvwise.kv.quantizer import make_quantizer
from kvwise.policies.base import Policy
from kvwise.policies.mix import Mix, parse_mix
from kvwise.policies.registry import make_policy
from kvwise.policies.selection import check_max_kv_tokens, check_ratio


@dataclass
class KVSettings:
    policy: str = "snapkv"
    ratio: float = 0.0  # fraction of the private prompt KV removed after prefill, in [0, 1)
    max_kv_tokens: int | None = None  # cap on private KV tokens per head while decoding
    quant: str | None = None
    options: dict = field(default_factory=dict)  # the policy's hyperparameters, e.g. {"window_size": 32}
    scorer: Policy = field(init=False, repr=False)

    @classmethod
    def from_mix(cls, mix: str | Mix) -> KVSettings:
        """Settings from a mix spec such as `kvzip@0.9+kivi4` (`policies.mix`)."""
        mix = parse_mix(mix)
        policy = mix.policy if mix.policy != "full" else "snapkv"
        return cls(policy, mix.ratio, mix.max_tokens, mix.quant, dict(mix.policy_options))

    @property
    def spec(self) -> str:
        """The canonical mix spelling of these settings (equal settings, equal specs): with a ratio
        and a cap both set, the cap follows as `@max=N` on a second spelling of the policy."""
        options = tuple(sorted(self.options.items()))
        mix = Mix(self.policy, options, self.ratio, None, self.quant) if self.evicts else Mix(quant=self.quant)
        spec = mix.spec
        return spec if self.max_kv_tokens is None else f"{spec}|max={self.max_kv_tokens}"

    def __post_init__(self):
        self.ratio = check_ratio(self.ratio, "kv_ratio")
        self.max_kv_tokens = check_max_kv_tokens(self.max_kv_tokens)
        if self.quant is not None:  # clear errors for bad names; one canonical spelling per quantizer
            quantizer = make_quantizer(self.quant)
            self.quant = None if quantizer is None else quantizer.spec
        self.scorer = make_policy(self.policy, **self.options)
        if getattr(self.scorer, "pass_chunk", 0):
            raise ValueError(
                "kvzip's pass_chunk (chunked reconstruction) runs in the library cache (KVWiseCache); "
                "the engine re-reads the context in one pass"
            )

    @property
    def evicts(self) -> bool:
        return not self.scorer.keeps_everything and (self.ratio > 0 or self.max_kv_tokens is not None)

    @property
    def selects_pages(self) -> bool:
        """Quest: nothing is evicted, and each decode step reads only the top pages per KV head."""
        return hasattr(self.scorer, "select_pages") and self.ratio > 0

    @property
    def active(self) -> bool:
        return self.evicts or self.quant is not None or self.selects_pages
