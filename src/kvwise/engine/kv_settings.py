"""`KVSettings`: a request's own KV policy, applied to its private blocks only.

    SamplingParams(...) plus KVSettings(policy="snapkv", ratio=0.5, max_kv_tokens=256)

- `policy` + `ratio`: when the prompt's prefill ends, the policy scores the request's private
  prompt tokens (everything after the prefix it reused from the cache) and each KV head keeps
  the best (1 - ratio) of them; the freed blocks go back to the pool, zeroed.
- `max_kv_tokens`: during decoding, whenever the private tokens exceed it by a block, the
  policy evicts down to it again.
- `quant` (kivi2, kivi4, int8, fp8): once the prefill is done, full private blocks outside the
  quantizer's residual window (and the first, sink block) are stored quantized (`QuantPool`).

Shared prefix blocks are never touched, and a request with settings never publishes its
private blocks to the prefix cache (they hold its compressed state, not the prompt's).
The engine supports policies that give every head the same budget from the tokens it holds
(no two-pass KVzip, no layer- or globally-shared budgets, no running statistics).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvwise.kv.quantizer import make_quantizer
from kvwise.policies.base import Policy
from kvwise.policies.registry import make_policy
from kvwise.policies.selection import check_max_kv_tokens, check_ratio


@dataclass
class KVSettings:
    policy: str = "snapkv"
    ratio: float = 0.0  # fraction of the private prompt KV removed after prefill, in [0, 1)
    max_kv_tokens: int | None = None  # cap on private KV tokens per head while decoding
    quant: str | None = None
    scorer: Policy = field(init=False, repr=False)

    def __post_init__(self):
        self.ratio = check_ratio(self.ratio, "kv_ratio")
        self.max_kv_tokens = check_max_kv_tokens(self.max_kv_tokens)
        if self.quant is not None:  # clear errors for bad names; one canonical spelling per quantizer
            quantizer = make_quantizer(self.quant)
            self.quant = None if quantizer is None else quantizer.spec
        if self.quant is not None:
            if self.max_kv_tokens is not None:
                raise ValueError(
                    "max_kv_tokens cannot be combined with kv_quant in the engine (quantized blocks are final)"
                )
        self.scorer = make_policy(self.policy)
        reasons = {
            "needs a second pass over the context": self.scorer.needs_context_pass,
            "moves budget between heads or layers": self.scorer.budget_scope != "head",
            "keeps running statistics": bool(self.scorer.stat_names),
        }
        for reason, applies in reasons.items():
            if applies:
                raise ValueError(f"policy {self.policy!r} {reason}, which the engine's per-request KV does not support")

    @property
    def evicts(self) -> bool:
        return not self.scorer.keeps_everything and (self.ratio > 0 or self.max_kv_tokens is not None)

    @property
    def active(self) -> bool:
        return self.evicts or self.quant is not None
