"""`StoredForm`: how a quantized mix holds each KV head's tokens, the same on every path.

The library's cache (`KVStore`) and the engine's quantized pages (`QuantPages`) follow one form,
so a mix keeps in the server the quality the library measures:

    sinks       the oldest `sink_tokens` tokens a head keeps, in the model's dtype (the attention
                sink's outlier keys would otherwise set a whole group's scale)
    quantized   everything else that has settled, in groups of `group_size` tokens: a KIVI key
                group shares one scale and minimum per channel; a head's last group holds the
                rest (the engine pads its page with copies of that group's own first row, which
                leave the group's range, and so its codes, as the library's shorter group has them)
    residual    the newest tokens, in the model's dtype, while a request decodes

When tokens settle: while decoding, `group_size` at a time, oldest first, once the residual
window holds `residual_length + group_size` of them (`settling`). A compressed context is frozen
when its compression is done: everything but the sinks is quantized at once; evicting first and
quantizing what is kept, never the other way round. What a head keeps after its sinks fills whole
pages (`fill_pages`): the page a head's last tokens would pad holds its next-best tokens instead,
so the bytes a ratio costs buy tokens, and both paths keep the same tokens at the same bytes. A
sliding-window layer keeps its window in the model's dtype (transformers' sliding layers, which
the library's cache keeps, hold it so).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Tokens of one head in one page of a per-token codec (int8, fp8, low-rank): no scale spans tokens,
# so any size works; one size on every path keeps the tokens a page fills the same everywhere.
PER_TOKEN_PAGE = 16


@dataclass(frozen=True)
class StoredForm:
    sink_tokens: int
    group_size: int  # tokens quantized together (1 for per-token codecs)
    residual_length: int
    groups_tokens: bool  # whether a codec's scale spans tokens (KIVI keys): then a page is one group

    @classmethod
    def of(cls, quantizer) -> StoredForm:
        groups = quantizer.key_codec.groups_tokens or quantizer.value_codec.groups_tokens
        return cls(quantizer.sink_tokens, quantizer.group_size, quantizer.residual_length, groups)

    def page_tokens(self) -> int:
        """Tokens of one head in one quantized page: one group where a scale spans tokens (so a
        page quantizes as the library's group does), else `PER_TOKEN_PAGE`."""
        return self.group_size if self.groups_tokens else PER_TOKEN_PAGE

    def settling(self, residual: torch.Tensor) -> torch.Tensor:
        """Tokens per head that leave a decoding residual window holding `residual` tokens."""
        window, group = self.residual_length, self.group_size
        return torch.where(residual >= window + group, (residual - window) // group * group, 0)

    def sinks(self, count: int) -> int:
        """The sinks of a frozen head that kept `count` tokens."""
        return min(count, self.sink_tokens)


def into_pages(rows: torch.Tensor, counts: list[int], page_tokens: int) -> torch.Tensor:
    """rows [sum(counts), dim], head after head -> pages [sum(ceil(count / page_tokens)),
    page_tokens, dim]. A head's last page is padded with copies of its own first row: a copy of a
    row already in the group changes neither its minimum nor its maximum, so the real rows get the
    codes that the library's shorter last group gives them."""
    pages, start = [], 0
    for count in counts:
        head = rows[start : start + count]
        start += count
        short = -count % page_tokens
        if short:
            last_page_start = count - (count % page_tokens)
            head = torch.cat([head, head[last_page_start : last_page_start + 1].expand(short, -1)])
        if count:
            pages.append(head.view(-1, page_tokens, rows.shape[-1]))
    return torch.cat(pages) if pages else rows.new_zeros(0, page_tokens, rows.shape[-1])


def fill_pages(keep: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor, page_tokens: int, sinks: int):
    """keep, scores, valid: [..., S] (one row per head) -> keep with each row's tokens after its
    `sinks` rounded up to whole pages of `page_tokens`, by the best-scoring valid tokens the row
    left out (as many as there are). A ratio sets how many tokens a head keeps; the page its last
    ones start is paid for whole, so it holds tokens rather than padding, on every path alike."""
    counts = keep.sum(dim=-1)
    quantized = counts - counts.clamp(max=sinks)
    spare = valid & ~keep
    extra = torch.minimum(-quantized % page_tokens, spare.sum(dim=-1))
    if page_tokens <= 1 or not bool((extra > 0).any()):
        return keep
    ranked = scores.float().nan_to_num(nan=float("-inf")).masked_fill(~spare, float("-inf"))
    order = ranked.argsort(dim=-1, descending=True, stable=True)
    # a spare token scored -inf still goes before any token that is not spare
    order = order.gather(-1, spare.gather(-1, order).to(torch.int8).argsort(dim=-1, descending=True, stable=True))
    take = torch.arange(keep.shape[-1], device=keep.device) < extra[..., None]
    return keep | torch.zeros_like(keep).scatter(-1, order, take)
