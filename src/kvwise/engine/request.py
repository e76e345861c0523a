"""A request's state inside the engine: tokens, progress, blocks, and where it waits."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvwise.core.radix import Node
from kvwise.engine.block_table import BlockTable
from kvwise.engine.sampling import SamplingParams

if TYPE_CHECKING:  # types only: these modules import this one
    import torch

    from kvwise.core.hashing import Namespace
    from kvwise.engine.context_pass import ReconstructionPass
    from kvwise.engine.core import CompletionOutput
    from kvwise.engine.detokenizer import IncrementalText
    from kvwise.engine.head_region import HeadRegion
    from kvwise.engine.kv_settings import KVSettings
    from kvwise.engine.swap import SwappedKV

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"


@dataclass(eq=False)
class Request:
    """prompt: token ids; blocks: its block table (one entry per block_size KV slots, and where it lives)."""

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = "default"
    # leading prompt tokens marked shared (a system prompt): looked up in, and published to, the
    # shared namespace; the rest of the prompt and the output stay in the tenant's own
    shared_prefix_tokens: int = 0
    may_publish_shared: bool = True  # False: a read-only key uses shared blocks others published
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    output: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the pool (reused prefix included)
    reused: int = 0  # of those, tokens matched in the prefix cache
    blocks: BlockTable = field(default_factory=BlockTable)  # written by the KVCacheManager only
    locked_nodes: list[Node] = field(default_factory=list)
    reserved: bool = False  # its first private allocation is made (whole or step by step)
    kv: KVSettings | None = None  # its own eviction of private tokens, or None
    # after an eviction its private tokens are in `region` (head pages), and a token at position p
    # computed since sits at KV index p - kv_offset of its block table (the tail, after the prefix)
    kv_offset: int = 0
    region: HeadRegion | None = None  # what each (layer, KV head) kept of its private tokens, or None
    kv_stats: list | None = None  # running statistics of its policy (H2O, Scissorhands) per layer, or None
    # the prompt's first compress_upto tokens are compressed once computed, before the rest is read
    # (query-agnostic: a document compressed without the question after it); None: at prefill's end
    compress_upto: int | None = None
    # prompt tokens from this position on are read one a step, as decoding reads them, so they
    # settle (quantize, and a cap evicts) where a generation's would: a scored continuation
    decode_from: int | None = None
    compressed_kv_bytes: int | None = None  # the KV bytes it held right after its ratio compression
    kv_bytes_read: int = 0  # keys and values its decode steps read (Quest reads a part of them)
    kv_bytes_held_read: int = 0  # what those steps would have read over everything it holds
    reconstruction: ReconstructionPass | None = None  # its KVzip pass while it runs (it waits meanwhile)
    # `auto`: the adaptive controller picks its mix at admission, for this class hint (retrieval,
    # chat, long_generation or auto: from its features); None: its own settings (or none) hold
    kv_auto: str | None = None
    # the adaptive controller's Choice (mix, class, reason), returned with the response; opaque here
    kv_choice: object | None = None
    kv_changes: list = field(default_factory=list)  # the controller's mixes for it, in order (`KVChange`)
    kept_score: float | None = None  # fraction of its policy's score its evictions kept (their product)
    turns: int = 0  # chat turns in its prompt, when known (a hint of its class)
    compressed_hit: bool = False  # it found its document compressed already (compress_upto) and reused it
    recompute_to: int | None = None  # set by a recompute preemption: len(tokens) then
    swapped: SwappedKV | None = None  # while preempted to host memory
    preemptions: int = 0
    skipped_steps: int = 0  # steps in a row its prefill got no tokens (the scheduler's anti-starvation)
    index: int = 0  # which of the prompt's `n` completions this is
    choice: int = 0  # its position among an API call's choices (prompts x n)
    generator: torch.Generator | None = None  # when the request has a seed
    logprobs: list[dict[int, float]] | None = None
    # SamplingParams.prompt_logprobs: per prompt token, its log-probability and the top
    # alternatives ({token: logprob}, its own first); the first token's is None (nothing before it)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank in its distribution (1: likeliest)
    completion: CompletionOutput | None = None  # set once finished
    first_token_time: float | None = None  # time.monotonic() when the first output token was sampled
    finish_time: float | None = None
    stop_text: IncrementalText | None = None  # an object watching for its stop strings
    error: str | None = None  # set when an internal fault in its part of a step cancelled it
    namespace: Namespace | None = None  # its block identity, fixed when the scheduler first asks

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def prefill_target(self) -> int:
        """Tokens to compute before sampling: the prompt, or after a recompute preemption the
        prompt and the output so far (the output is kept, so streams never repeat)."""
        return len(self.prompt) if self.recompute_to is None else self.recompute_to

    @property
    def forced_from(self) -> int | None:
        """Where its prompt starts being read one token a step: `decode_from`, else, for the
        scored continuation of a mix (its own or the one `auto` assigned), `compress_upto`."""
        if self.decode_from is not None:
            return self.decode_from
        return self.compress_upto if self.kv is not None and self.prompt_logprobs is not None else None

    @property
    def compression_point(self) -> int:
        """The position after the last token its ratio compresses (see `compress_upto`): its
        document's end, else where its prompt starts being read as a generation reads its tokens
        (`decode_from`), else its prefill's end."""
        if self.compress_upto is not None:
            return self.compress_upto
        return self.prefill_target if self.decode_from is None else self.decode_from  # never past the prompt

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prefill_target

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.CANCELLED)
