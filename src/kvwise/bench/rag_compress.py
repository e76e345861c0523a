"""`kvwise bench rag --compress MIX`: compress once, answer many, on the RAG workload.

Each request's system prompt and document are compressed query-agnostically with MIX (for
example `kvzip@0.75+kivi4`) the first time they are seen; every later request with the same
system prompt and document reuses the compressed KV and computes only its question. Beside
plain prefix reuse in the same run, the report gives:

- TTFT p50 of the requests that found their document cached, compressed and plain;
- the bytes a cached compressed document holds, against the same tokens uncompressed;
- answers: how many first `MATCH_TOKENS` output tokens equal the full cache's (plain reuse's),
  and the library path's for the same mix (`CompressedContexts` + greedy decoding).
"""

from __future__ import annotations

import statistics

import torch

from kvwise.hf.generation import greedy_continue
from kvwise.policies.mix import parse_mix

MATCH_TOKENS = 8


def library_answers(model, tokenizer, parts: list[tuple[list[int], int]], mix: str, tokens: int, progress) -> list:
    """The library path's greedy answers for every request: each distinct context compressed
    once with `mix` (CompressedContexts on host memory), then the question read and decoded."""
    from kvwise.hf.compressed_contexts import CompressedContexts
    from kvwise.tiers.host import HostTier

    mix = parse_mix(mix)
    contexts = CompressedContexts(HostTier(1 << 34))
    answers = []
    for ids, end in parts:
        context = torch.tensor([ids[:end]], device=model.device)
        cache = contexts.get_or_compress(
            model, context, mix.policy, mix.ratio, mix.quant, tokenizer, **mix.options_dict()
        )
        question = torch.tensor([ids[end:]], device=model.device)
        answers.append(greedy_continue(model, cache, question, tokens)[0].tolist())
        progress.update()
    return answers


def compression_summary(plain: dict, compressed: dict, library: list | None) -> dict:
    """The compressed system against plain reuse (and the library path), from their rows."""

    def matching(answers: list) -> float:
        pairs = list(zip(compressed["outputs"], answers))
        return sum(a[:MATCH_TOKENS] == b[:MATCH_TOKENS] for a, b in pairs) / len(pairs)

    summary = {
        "hit_ttft_ratio": compressed["document_hit_ttft_p50_s"] / plain["document_hit_ttft_p50_s"],
        "cached_bytes_ratio": compressed["cached_document_bytes_ratio"],
        "first_tokens_match_full": matching(plain["outputs"]),
    }
    if library is not None:
        summary["first_tokens_match_library"] = matching(library)
    return summary


def document_hit_ttft(requests_in_order, hits: list[bool]) -> float | None:
    times = [r.first_token_time - r.arrival for r, hit in zip(requests_in_order, hits) if hit]
    return statistics.median(times) if times else None
