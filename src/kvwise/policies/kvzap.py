"""`kvzap`: KVzip's selection without KVzip's second pass.

Paper: "KVzap" (arXiv 2601.07891; kvpress's `KVzapPress`). KVzip scores a token by the largest
attention it draws while the model reconstructs the context, which costs a second pass over it.
kvzap predicts that score from the token's hidden state at each layer with a small learned head
(`score_surrogate.ScoreSurrogate`, trained by `kvwise calibrate` to match KVzip on the user's
model), during the prefill itself: no extra pass. Selection is KVzip's: one threshold over every
layer and head, so heads KVzip would keep busy keep many tokens.

The predicted scores are a running statistic (`observe`): each forward scores the tokens it
computed, from that forward's hidden states, and earlier tokens keep theirs. So a prompt
prefilled in chunks by the serving engine is scored whole when its compression point comes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwise.policies.base import PROTECTED, Policy
from kvwise.policies.registry import register
from kvwise.policies.score_surrogate import ScoreSurrogate, find_surrogate

_LOADED: dict[tuple[str, str | None], ScoreSurrogate | None] = {}


@register
@dataclass
class KVzapPolicy(Policy):
    name = "kvzap"
    summary = "KVzip's scores predicted from hidden states by a calibrated head: no second pass"
    paper = "https://arxiv.org/abs/2601.07891"
    budget_scope = "global"
    needs_hidden_states = True
    stat_names = ("kvzap",)
    surrogate_path: str | None = None  # a .kvzap.safetensors file (default: the model's, by fingerprint)
    num_sinks: int = 4
    pool_kernel: int = 1  # max-pool scores over this many neighbouring tokens (odd; 1 = off)
    recent_window: int = 0  # the context's last tokens, kept in every head (within the budget)

    def __post_init__(self):
        self.surrogate: ScoreSurrogate | None = None
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel must be an odd number >= 1, got {self.pool_kernel}")
        if self.recent_window < 0:
            raise ValueError(f"recent_window is a number of tokens >= 0, got {self.recent_window}")

    def attach(self, model) -> None:
        """Load the surrogate trained on `model`'s weights; a clear error names how to make one."""
        from kvwise.util.fingerprint import weights_fingerprint

        fingerprint = weights_fingerprint(model)
        key = (fingerprint, self.surrogate_path)
        if _LOADED.get(key) is None:  # one read per model and file, not one per request
            _LOADED[key] = find_surrogate(fingerprint, self.surrogate_path)
        self.surrogate = _LOADED[key]
        if self.surrogate is None:
            raise ValueError(
                f"kvzap needs a score surrogate trained on this model (weights {fingerprint}): run "
                "`kvwise calibrate --model <it>` (it trains one in minutes), or pick kvzip"
            )

    def observe(self, scoring):
        """Scores of the tokens this forward computed (the last `query_len` slots), from its hidden
        states; earlier tokens keep the scores they were given. {"kvzap": [batch, kv_heads, seq_len]}."""
        held = scoring.stats.get("kvzap")
        if held is None or held.shape != scoring.valid.shape:
            held = torch.zeros(scoring.valid.shape, dtype=torch.float32, device=scoring.keys.device)
        hidden = scoring.hidden_states
        if hidden is None:
            return {"kvzap": held}
        if self.surrogate is None:
            raise ValueError("kvzap was not attached to a model: build it through KVWiseCache or kvwise.LLM")
        held = held.clone()
        held[:, :, scoring.seq_len - hidden.shape[1] :] = self.surrogate.log_scores(scoring.layer_idx, hidden).exp()
        return {"kvzap": held}

    def score(self, scoring):
        scores = scoring.stats.get("kvzap")
        if scores is None:
            # A decode-time budget over tokens no forward scored: the newest query's attention.
            return scoring.attention_received(last_queries=1, reduce="max")
        if self.pool_kernel > 1:
            batch, heads, seq_len = scores.shape
            scores = torch.nn.functional.max_pool1d(
                scores.reshape(batch * heads, 1, seq_len), self.pool_kernel, stride=1, padding=self.pool_kernel // 2
            ).view(batch, heads, seq_len)
        scores = scores.masked_fill(~scoring.valid, 0.0)
        return scores.masked_fill(scoring.sink_mask(self.num_sinks), PROTECTED)
