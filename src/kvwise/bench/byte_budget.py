"""Equal-bytes cells of `kvwise bench niah --budget-bytes`: the ratio at which a mix holds a budget.

A budget is the bytes a context's KV holds after compression (before the question), everything
the cache keeps counted (codes, scales, residual windows, sinks, positions), as a fraction of a
16-bit full cache of the same context, whatever the model's dtype. What a mix holds is affine in
the tokens each head keeps, for a given quantizer: `ByteSizer` measures the two coefficients once
per quantizer on a short context with a policy that keeps the same count in every head, and
solves for the tokens per head, hence the ratio, that fill the budget. The trial then reports the
bytes it really held.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvwise.hf.cache import KVWiseCache, full_kv_bytes
from kvwise.kv.quantizer import quantizer_names
from kvwise.policies.mix import Mix, parse_mix

# evict-and-quantize mixes first: at a few percent of the bytes only they are in reach
DEFAULT_BUDGET_MIXES = (
    "kvzip+kivi2",
    "kvzap+kivi2",
    "snapkv+kivi2",
    "kvzip+kivi4",
    "kvzap+kivi4",
    "kvzip",
    "kvzap",
    "kivi2",
)
PROBE_TOKENS = 256
MARGIN = 0.025


def check_budgets(budgets: list[float]) -> list[float]:
    for budget in budgets:
        if not 0 < budget <= 1:
            raise ValueError(
                f"--budget-bytes values are fractions of a 16-bit full cache's bytes, in (0, 1]; got {budget}"
            )
    return list(budgets)


_PLACEHOLDER = "@0.5"


def budget_mix(text: str) -> Mix:
    """A mix for a byte budget: a policy and/or a quantizer, without a ratio (the budget sets it)."""
    parts = [part.strip() for part in str(text).split("+")]
    if any("@" in part for part in parts):
        raise ValueError(f"mix {text!r}: with --budget-bytes the budget sets the ratio; leave out '@...'")
    fixed = {*quantizer_names(), "kivi", "none", "full"}
    # a placeholder ratio lets the one mix parser check the policy and its options
    spelled = [part if part.split(":", 1)[0].lower() in fixed else f"{part}{_PLACEHOLDER}" for part in parts]
    try:
        mix = parse_mix("+".join(spelled))
    except ValueError as error:  # name what the user wrote, not the placeholder
        raise ValueError(str(error).replace(_PLACEHOLDER, "")) from None
    return dataclasses.replace(mix, ratio=0.0)


@dataclass(frozen=True)
class Solved:
    ratio: float | None  # None: the mix cannot hold the budget
    note: str = ""


class ByteSizer:
    """Bytes = fixed + per_token x tokens kept per head, per quantizer, for `model`."""

    def __init__(self, model):
        self.model = model
        self._coefficients: dict[str | None, tuple[float, float]] = {}

    def coefficients(self, quant: str | None) -> tuple[float, float]:
        if quant not in self._coefficients:
            generator = torch.Generator().manual_seed(0)
            vocab = self.model.config.get_text_config(decoder=True).vocab_size
            ids = torch.randint(3, vocab, (1, PROBE_TOKENS), generator=generator).to(self.model.device)
            kept, held = [], []
            for ratio in (0.25, 0.75):
                cache = KVWiseCache(self.model, policy="streaming_llm", compression_ratio=ratio, quant=quant)
                cache.compress_context(ids)
                kept.append(_kept_per_head(cache))
                held.append(cache.nbytes())
            per_token = (held[1] - held[0]) / (kept[1] - kept[0])
            self._coefficients[quant] = (held[0] - per_token * kept[0], per_token)
        return self._coefficients[quant]

    def solve(self, mix: Mix, num_tokens: int, budget: float, page_tokens: int = 1) -> Solved:
        """The ratio at which `mix` holds `budget` of a 16-bit full cache of `num_tokens` tokens.

        page_tokens: the tokens of one head in one page of the mix's stored form; a head's last
        page is paid for whole, on average half a page more than the ratio keeps, which the budget
        pays for (a quantized mix fills it with tokens on both paths; 1: nothing is paged)."""
        # KIVI rounds groups per head, and a global selection spreads tokens unevenly over heads:
        # aim a hair under the budget so the bytes really held stay within it
        allowed = budget * full_kv_bytes(self.model, num_tokens, 2) * (1 - MARGIN)
        fixed, per_token = self.coefficients(mix.quant)
        fixed += (page_tokens - 1) / 2 * per_token
        if fixed + per_token * num_tokens <= allowed:
            return Solved(0.0)  # no eviction needed
        if mix.policy == "full":
            whole = (fixed + per_token * num_tokens) / full_kv_bytes(self.model, num_tokens, 2)
            return Solved(None, f"holds {whole:.3f} without eviction")
        tokens = int((allowed - fixed) // per_token)
        if tokens < 1:
            return Solved(None, "needs less than one token per head")
        return Solved(1.0 - tokens / num_tokens)


def _kept_per_head(cache: KVWiseCache) -> int:
    counts = [layer.kept_tokens().float().mean().item() for layer in cache.compressing_layers]
    return round(sum(counts) / len(counts))
