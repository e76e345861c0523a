"""`kvzip`: query-agnostic importance by context reconstruction.

Paper: Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
arXiv 2505.23416. After the context is prefilled, the model reads "repeat the previous context"
followed by the context once more. A cached token's score is the largest attention any
reconstruction query (of its GQA group) pays it. One threshold over every layer and head then
keeps the top tokens, so heads that copy keep many tokens and idle heads keep few; the storage
is variable-length, so that memory is really freed (kvpress only masks). Costs one extra pass.
"""

from dataclasses import dataclass

import torch

from kvwise.policies.base import PROTECTED, Policy
from kvwise.policies.registry import register


@register
@dataclass
class KVzipPolicy(Policy):
    name = "kvzip"
    summary = "context-reconstruction attention, one budget over all heads and layers"
    paper = "https://arxiv.org/abs/2505.23416"
    budget_scope = "global"
    needs_context_pass = True
    repeat_prompt: str = "\n\nRepeat the previous context exactly.\n\n"
    num_sinks: int = 4
    chunk_size: int = 256

    def context_pass_inputs(self, input_ids, attention_mask, tokenizer):
        """The reconstruction pass: [repeat prompt, context]; its mask covers the cached context too."""
        batch = input_ids.shape[0]
        prompt_ids = []
        if tokenizer is not None:
            prompt_ids = tokenizer(self.repeat_prompt, add_special_tokens=False).input_ids
        prompt = torch.tensor(prompt_ids, dtype=input_ids.dtype, device=input_ids.device).expand(batch, -1)
        pass_ids = torch.cat([prompt, input_ids], dim=1)
        if attention_mask is None:
            return pass_ids, None
        ones = torch.ones_like(prompt, dtype=attention_mask.dtype)
        return pass_ids, torch.cat([attention_mask, ones, attention_mask], dim=1)

    def score_reconstruction(self, scoring):
        """Max attention from reconstruction queries: [batch, num_kv_heads, seq_len] float32."""
        best = torch.zeros(scoring.valid.shape, dtype=torch.float32, device=scoring.keys.device)
        for start in range(0, scoring.query_len, self.chunk_size):
            end = min(start + self.chunk_size, scoring.query_len)
            probs = scoring.attention_probs(start, end)  # [batch, heads, group, rows, seq_len]
            best = torch.maximum(best, probs.amax(dim=(2, 3)))
        return best.masked_fill(scoring.sink_mask(self.num_sinks), PROTECTED)

    def score(self, scoring):
        # Used only for decode-time budgets: the newest query's attention.
        return scoring.attention_received(last_queries=1, reduce="max")
