"""Score a reference reply in the serving engine, under the KV a request held while it generated.

Each (prompt, reply) is sent as one request of prompt + reply. The prompt is computed as a request
of the scored system computed it (its document, `compress_upto`, compressed before its question
is read; the rest of the prompt at its prefill's end), and the reply is read one token a step
through the decode path (`decode_from`), as a generation reads its own tokens, with each token's
log-probability kept (`prompt_logprobs`). Nothing is generated but one token.

A request whose KV changed while it ran (the adaptive controller quantized or capped it: its
`kv_changes`) is replayed: a controller makes the same changes when the same number of tokens
is in KV memory, so each reply token is scored under the KV its position was generated with, not
under the KV the request ended with. Requests run a few at a time, so a long-context batch stays
within a pool of `pool_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tqdm import tqdm

from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.kv_actions import AssignMix, KVChange
from kvwise.engine.sampling import SamplingParams


@dataclass(frozen=True)
class ScoredReply:
    """prompt, reply: token ids; plan: the mixes the request held and when (`KVChange.at`; one at
    0 is its mix from the start; empty: the full cache); document_end: the tokens compressed
    before the rest of the prompt is read (`compress_upto`), None: the whole prompt."""

    prompt: list[int]
    reply: list[int]
    plan: tuple[KVChange, ...] = ()
    document_end: int | None = None


class _ReplayChanges:
    """A KV controller that makes each request's logged changes after its first at the token counts
    they were made at (`EngineCore.attach_controller`)."""

    def __init__(self):
        self.pending: dict = {}  # engine request -> its changes still to make, in order

    @staticmethod
    def check_hint(hint: str) -> None:
        raise ValueError("a replay makes logged changes only; it chooses no mix")

    def admit(self, request, view) -> None:
        return None

    def before_step(self, view) -> list[AssignMix]:
        actions = []
        for running in view.running:
            changes = self.pending.get(running.request)
            while changes and running.request.computed >= changes[0].at:
                change = changes.pop(0)
                actions.append(AssignMix(running.request, change.mix, quantize_now=change.quantize_now, kind="replay"))
        return actions


def replay_nll(
    model,
    tokenizer,
    items: list[ScoredReply],
    pool_tokens: int = 32768,
    block_size: int = CacheConfig.block_size,
    progress: str | None = None,
) -> list[float]:
    """Mean negative log-likelihood of each item's reply after its prompt, under its plan.
    block_size: the live engine's, as blocks settle (quantize) a block at a time; progress: a
    progress bar's label (None: no bar)."""
    block = block_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    scores: list[float] = []
    batches = _batches(items, pool_tokens)
    for batch in tqdm(batches, desc=progress, unit="batch", disable=progress is None or not batches):
        # room for each request and a KVzip pass over its prompt (about as long again)
        blocks = sum(2 * -(-(len(item.prompt) + len(item.reply) + 1) // block) for item in batch) + 16
        core = EngineCore(model, tokenizer, CacheConfig(block_size=block, num_blocks=blocks, prefix_caching=False))
        replay = _ReplayChanges()
        core.attach_controller(replay)
        requests = []
        for item in batch:
            first = item.plan[0].mix if item.plan and item.plan[0].at == 0 else None
            request = core.make_request(
                item.prompt + item.reply,
                params,
                kv=first,
                # the mix compresses where the live request's did: its document, else (decode_from)
                # its whole prompt
                compress_upto=item.document_end if first is not None else None,
                decode_from=len(item.prompt),
            )
            replay.pending[request] = [change for change in item.plan if change.at > 0]
            requests.append(request)
            core.add(request)
        while core.has_work:
            core.step()
        for item, request in zip(batch, requests):
            if request.error is not None:
                plan = " then ".join(f"{c.mix} at {c.at}" for c in item.plan) or "full"
                raise RuntimeError(f"scoring under {plan} failed: {request.error}")
            scored = request.prompt_logprobs[len(item.prompt) :]  # each reply token given all before it
            scores.append(-sum(entry[token] for entry, token in zip(scored, item.reply)) / len(item.reply))
    return scores


def reply_nll(
    model, tokenizer, settings: str | None, items: list[tuple[list[int], list[int]]], pool_tokens: int = 32768
) -> list[float]:
    """Mean negative log-likelihood of each reply after its prompt, under one mix `settings` held
    from the start (None: the full cache). items: [(prompt ids, reply ids)]."""
    plan = (KVChange(0, settings),) if settings is not None else ()
    return replay_nll(model, tokenizer, [ScoredReply(prompt, reply, plan) for prompt, reply in items], pool_tokens)


def _batches(items: list[ScoredReply], pool_tokens: int) -> list[list[ScoredReply]]:
    """Consecutive groups whose prompts and replies, twice over, fit `pool_tokens` (one at least)."""
    batches, current, used = [], [], 0
    for item in items:
        need = 2 * (len(item.prompt) + len(item.reply))
        if current and used + need > pool_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(item)
        used += need
    if current:
        batches.append(current)
    return batches
