"""`kvzip`: query-agnostic importance by context reconstruction.

Paper: Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
arXiv 2505.23416. A cached token's score is the largest attention that a query reconstructing
the context pays it (over the query heads of its GQA group). One threshold over every layer and
head then keeps the top tokens, so copying heads keep many tokens and idle heads few; storage is
variable-length, so that memory is really freed (kvpress only masks).

Two ways to get the reconstruction queries:
- `reconstruction="pass"` (default, the paper): after the prefill, the model reads "repeat the previous
  context" and the context again. It costs one more pass over the context and only works
  through `KVWiseCache.compress_context`.
- `reconstruction="self"` (our cheaper experiment, weaker: see docs/benchmarks.md): a token re-read
  during reconstruction sees the same preceding text as at its first reading, so its query is close to the prefill's
  query for that token, moved later by the length of the context. We reuse the prefill queries,
  rotated by that offset (RoPE composes), and let them see the whole context (no causal mask),
  as reconstruction queries would. No extra forward pass; it also works inside `generate`.
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
    reconstruction: str = "pass"
    repeat_prompt: str = "\n\nRepeat the previous context exactly."
    num_sinks: int = 4
    query_stride: int = 1  # score every n-th reconstruction query (1 = all)
    shared_fraction: float = 0.0  # share of the budget kept as the same tokens in every head
    recent_window: int = 0  # the context's last tokens, kept in every head (within the budget)
    max_head_share: float = 0.0  # a head keeps at most this many times the mean budget (0 = no cap)
    pool_kernel: int = 1  # max-pool scores over this many neighbouring tokens (odd; 1 = off)
    credit: str = "all"  # self mode: which slots a query's attention credits (all, future, past)
    chunk_size: int = 128
    # KVzip's chunked reconstruction: re-read the context in passes of this many tokens, each
    # [repeat prompt, chunk] attending to the whole context; 0 re-reads it in one pass. Chunks
    # keep the pass's positions within the context length plus one chunk (a model trained on
    # 8K positions cannot re-read 4K tokens after 4K in one pass without leaving its range).
    pass_chunk: int = 0

    def __post_init__(self):
        if self.reconstruction not in ("self", "pass"):
            raise ValueError(f"reconstruction must be 'self' or 'pass', got {self.reconstruction!r}")
        if self.query_stride < 1 or self.chunk_size < 1:
            raise ValueError("query_stride and chunk_size must be >= 1")
        if self.recent_window < 0:
            raise ValueError(f"recent_window is a number of tokens >= 0, got {self.recent_window}")
        if self.pass_chunk < 0:
            raise ValueError(f"pass_chunk is a number of tokens >= 1, or 0 for one pass; got {self.pass_chunk}")

    def head_ceiling(self, budget):
        return None if self.max_head_share <= 0 else max(1, int(self.max_head_share * budget))

    @property
    def needs_context_pass(self) -> bool:
        return self.reconstruction == "pass"

    def context_pass_inputs(self, input_ids, attention_mask, tokenizer):
        """The reconstruction pass: [repeat prompt, end of user turn, context again].

        With a chat tokenizer the prompt closes the user turn and opens the assistant's, so the
        model is answering "repeat the context" (as kvpress does); a chat head at the start of
        `input_ids` (the system prompt) is not re-read. The returned mask also covers the cached
        context. Returns (pass_ids [batch, n], pass_mask [batch, cached + n] or None).
        """
        batch = input_ids.shape[0]
        head_ids, suffix_text = [], "\n"
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            head_ids, suffix_text = _chat_head_and_suffix(tokenizer)
        prompt_ids = []
        if tokenizer is not None:
            prompt_ids = tokenizer(self.repeat_prompt + suffix_text, add_special_tokens=False).input_ids
        start = len(head_ids) if head_ids and input_ids[0, : len(head_ids)].tolist() == head_ids else 0
        self.reread_start = start
        prompt = torch.tensor(prompt_ids, dtype=input_ids.dtype, device=input_ids.device).expand(batch, -1)
        pass_ids = torch.cat([prompt, input_ids[:, start:]], dim=1)
        if attention_mask is None:
            return pass_ids, None
        ones = torch.ones_like(prompt, dtype=attention_mask.dtype)
        return pass_ids, torch.cat([attention_mask, ones, attention_mask[:, start:]], dim=1)

    def context_passes(self, input_ids, attention_mask, tokenizer) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Every reconstruction pass: one (`context_pass_inputs`), or with `pass_chunk`, one per
        chunk of the re-read context, each [prompt, chunk] with a mask over the whole context
        (the pass's own tokens are never kept, so each sees the context alone)."""
        pass_ids, pass_mask = self.context_pass_inputs(input_ids, attention_mask, tokenizer)
        reread = input_ids.shape[1] - self.reread_start
        if self.pass_chunk == 0 or reread <= self.pass_chunk:
            return [(pass_ids, pass_mask)]
        prompt_len = pass_ids.shape[1] - reread
        prompt = pass_ids[:, :prompt_len]
        passes = []
        for begin in range(0, reread, self.pass_chunk):
            chunk = pass_ids[:, prompt_len + begin : prompt_len + begin + self.pass_chunk]
            mask = None
            if attention_mask is not None:
                context_mask = attention_mask[:, self.reread_start + begin : self.reread_start + begin + chunk.shape[1]]
                ones = torch.ones_like(prompt, dtype=attention_mask.dtype)
                mask = torch.cat([attention_mask, ones, context_mask], dim=1)
            passes.append((torch.cat([prompt, chunk], dim=1), mask))
        return passes

    def _max_attention(self, scoring, queries, first_slot, simulated=False) -> torch.Tensor:
        best = torch.zeros(scoring.valid.shape, dtype=torch.float32, device=scoring.keys.device)
        rows = queries[:, :, :: self.query_stride]
        slots = torch.arange(scoring.seq_len, device=scoring.keys.device)
        for start in range(0, rows.shape[2], self.chunk_size):
            chunk = rows[:, :, start : start + self.chunk_size]
            row_slots = (start + torch.arange(chunk.shape[2], device=slots.device)) * self.query_stride
            chunk_first = None if first_slot is None else first_slot + row_slots
            probs = scoring.probs_for(chunk, chunk_first)  # [batch, heads, group, rows, seq_len]
            if simulated and self.credit != "all":
                if self.credit == "future":
                    probs = probs * (slots[None, :] > row_slots[:, None])
                else:
                    probs = probs * (slots[None, :] <= row_slots[:, None])
            best = torch.maximum(best, probs.amax(dim=(2, 3)))
        if self.pool_kernel > 1:
            # Keep the neighbours of strong tokens with them: a needle is a phrase, not a token.
            batch, heads, seq_len = best.shape
            best = torch.nn.functional.max_pool1d(
                best.view(batch * heads, 1, seq_len), self.pool_kernel, stride=1, padding=self.pool_kernel // 2
            ).view(batch, heads, seq_len)
        return best.masked_fill(scoring.sink_mask(self.num_sinks), PROTECTED)

    def score_reconstruction(self, scoring):
        """Scores from the real reconstruction pass: [batch, num_kv_heads, seq_len] float32.

        Only re-read tokens earn credit. The chat head before the context (the system prompt) is
        not re-read; its tokens draw sink-like attention from every head and would otherwise
        fill most of a small budget. The first `num_sinks` tokens stay protected.
        """
        scores = self._max_attention(scoring, scoring.queries, scoring.seq_len - scoring.query_len)
        not_reread = torch.arange(scoring.seq_len, device=scores.device) < getattr(self, "reread_start", 0)
        return scores.masked_fill(not_reread & ~scoring.sink_mask(self.num_sinks), 0.0)

    def score(self, scoring):
        if scoring.query_len < scoring.seq_len:
            # A decode-time budget: only the newest query is at hand.
            return scoring.attention_received(last_queries=1, reduce="max")
        queries = scoring.queries
        if scoring.rotate_queries is not None:
            queries = scoring.rotate_queries(queries, scoring.seq_len, scoring.layer_idx)
        return self._max_attention(scoring, queries, None, simulated=True)


def _chat_head_and_suffix(tokenizer) -> tuple[list[int], str]:
    """Token ids of the chat template before a user message, and its text after the message."""
    marker = "\u2063kvwise-context\u2063"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
    )
    head, suffix = text.split(marker)
    return tokenizer(head, add_special_tokens=False).input_ids, suffix
