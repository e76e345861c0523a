"""Score a reference reply under a request's KV settings, in the serving engine.

Each (prompt, reply) is sent as one request of prompt + reply, with all but the prompt's last
token compressed under the settings (`compress_upto`) and the reply read by its prompt logprobs,
as the engine holds the compressed context; nothing is generated but one token. Requests run a
few at a time, so a long-context batch stays within a pool of `pool_tokens`.
"""

from __future__ import annotations

from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.kv_settings import resolve
from kvwise.engine.sampling import SamplingParams


def reply_nll(
    model, tokenizer, settings: str | None, items: list[tuple[list[int], list[int]]], pool_tokens: int = 32768
) -> list[float]:
    """Mean negative log-likelihood of each reply after its prompt, under `settings` (a mix spec;
    None: the full cache). items: [(prompt ids, reply ids)]."""
    block = CacheConfig.block_size
    kv = resolve(settings) if settings is not None else None
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    scores: list[float] = []
    for batch in _batches(items, pool_tokens):
        # room for each request and a KVzip pass over its prompt (about as long again)
        blocks = sum(2 * -(-(len(prompt) + len(reply) + 1) // block) for prompt, reply in batch) + 16
        core = EngineCore(model, tokenizer, CacheConfig(num_blocks=blocks, prefix_caching=False))
        requests = [
            core.make_request(prompt + reply, params, kv=kv, compress_upto=len(prompt) - 1 if kv else None)
            for prompt, reply in batch
        ]
        for request in requests:
            core.add(request)
        while core.has_work:
            core.step()
        for (prompt, reply), request in zip(batch, requests):
            if request.error is not None:
                raise RuntimeError(f"scoring under {settings or 'full'} failed: {request.error}")
            scored = request.prompt_logprobs[len(prompt) :]  # each reply token given all before it
            scores.append(-sum(entry[token] for entry, token in zip(scored, reply)) / len(reply))
    return scores


def _batches(items: list, pool_tokens: int) -> list[list]:
    """Consecutive groups whose prompts and replies, twice over, fit `pool_tokens` (one at least)."""
    batches, current, used = [], [], 0
    for item in items:
        need = 2 * (len(item[0]) + len(item[1]))
        if current and used + need > pool_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(item)
        used += need
    if current:
        batches.append(current)
    return batches
