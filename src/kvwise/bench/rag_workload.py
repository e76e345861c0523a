"""The RAG workload of ../docs BENCHMARKS, shared by `bench reuse` and `bench rag`.

70% of requests (`shared_fraction`) share one system prompt; each carries a document drawn with
Zipf popularity from a pool of essay slices, and a question; all slices are consecutive,
non-overlapping pieces of the essays, so nothing repeats by accident.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kvwise.bench.haystack import read_haystack


@dataclass
class RagWorkload:
    requests: int = 24
    shared_fraction: float = 0.7
    system_prompt_tokens: int = 500
    documents: int = 6
    document_tokens: tuple[int, int] = (1000, 2000)
    question_tokens: tuple[int, int] = (50, 200)
    output_tokens: int = 32
    zipf_exponent: float = 1.1
    seed: int = 0

    def __post_init__(self):
        if self.requests < 2:
            raise ValueError(f"need requests >= 2, got {self.requests}")
        if not 0.0 <= self.shared_fraction <= 1.0:
            raise ValueError(f"shared_fraction must be in [0, 1], got {self.shared_fraction}")


def rag_requests(tokenizer, config: RagWorkload) -> list[torch.Tensor]:
    """The RAG workload's prompts as token ids [1, n], deterministic for a seed."""
    return [torch.tensor([ids]) for ids, _ in rag_prompts(tokenizer, config)]


def rag_prompts(tokenizer, config: RagWorkload) -> list[tuple[list[int], int]]:
    """The RAG workload's prompts as (token ids, where the document ends: the system prompt and
    the document before it, the question after it), deterministic for a seed."""
    rng = random.Random(config.seed)
    stream = tokenizer(read_haystack(), add_special_tokens=False).input_ids
    cursor = 0

    def take(count: int) -> list[int]:
        nonlocal cursor
        if cursor + count > len(stream):
            raise ValueError("the essays are too short for this RAG configuration")
        piece = stream[cursor : cursor + count]
        cursor += count
        return piece

    system_prompt = take(config.system_prompt_tokens)
    documents = [take(rng.randint(*config.document_tokens)) for _ in range(config.documents)]
    weights = [1.0 / (rank + 1) ** config.zipf_exponent for rank in range(config.documents)]
    requests = []
    for _ in range(config.requests):
        shared = rng.random() < config.shared_fraction
        document = rng.choices(documents, weights)[0]
        question = take(rng.randint(*config.question_tokens))
        prefix = system_prompt if shared else take(config.system_prompt_tokens)  # a one-off prompt
        requests.append((prefix + document + question, len(prefix) + len(document)))
    return requests
