"""Read-only views of KV memory that the `KVCacheManager` hands out: what the model runner reads
and writes through, where the prefix blocks are for a router, and what a KV controller sees
before each step."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvwise.engine.quant_pool import QuantPool
from kvwise.kv.paged import PagedKVStorage

if TYPE_CHECKING:  # types only
    from kvwise.engine.kv_actions import Outcome
    from kvwise.engine.request import Request


@dataclass(frozen=True)
class RoutingSnapshot:
    """Where an engine's prefix blocks are (block keys), and what restoring one costs per tier."""

    device: list[bytes]
    host: list[bytes]
    published: list[bytes]
    restore_seconds_per_block: dict[str, float]


@dataclass(frozen=True)
class RunnerView:
    """The model runner's read-only view of KV memory: where blocks are read and written."""

    storage: PagedKVStorage
    quant_pools: Mapping[str, QuantPool]


@dataclass(frozen=True)
class RunningRequest:
    """One running request as a controller sees it. `request` is the handle its actions name; a
    controller reads these fields, never the request's own."""

    request: Request
    request_id: str
    tokens: int  # prompt and output so far
    prompt_tokens: int
    reused: int  # prompt tokens served by the prefix cache
    past_prefill: bool  # its prompt is computed and no context pass runs for it
    kv_auto: str | None  # its class hint when the controller chooses its mix, else None
    kv_choice: object | None  # the controller's label of its mix (AssignMix.label)
    has_settings: bool  # a mix of its own (explicit or assigned)
    evicts: bool
    quantized: bool  # a quantizer in its mix, or quantized blocks
    kept_score: float | None  # fraction of its policy's score its evictions kept
    held_bytes: int  # KV bytes it holds now
    has_region: bool  # its eviction ran (it holds head pages)
    remaining_tokens: int = 0  # output tokens it may still produce
    kv_form: str = "full"  # how it holds its KV for a cost model: full, evicted, or its quantizer's name


@dataclass(frozen=True)
class ControllerView:
    """KV memory and the scheduler's pressure, read once before a step (or an admission, where
    `running` and `outcomes` are empty)."""

    usage: float  # share of the device pool's blocks not free
    free_blocks: int
    num_blocks: int
    block_size: int
    block_bytes: int
    has_tiers: bool
    memory_stalls: int  # prefill chunks that found no blocks, since the engine started
    preemptions: int
    swapped_out_blocks: int
    recomputed_blocks: int
    quantization_errors: dict[str, tuple[float, float]]  # quantizer spec -> mean (keys, values) error
    running: tuple[RunningRequest, ...] = ()
    outcomes: tuple[Outcome, ...] = ()  # of the actions answered before the last step
    held_back_tokens: tuple[int, ...] = ()  # KV tokens each waiting or still-prefilling request will hold
    last_step: LastStep | None = None  # the step just run, for a cost model's online correction
    # an admission of a request with a document (`compress_upto`): its leading tokens up to the
    # document's end that the prefix cache holds in full, on the device or in the tiers
    document_cached_tokens: int = 0


@dataclass(frozen=True)
class LastStep:
    """The engine's last step: its wall seconds, how many requests it decoded a token for, and
    whether that was all it did (no prefill chunk, no context pass)."""

    seconds: float
    decodes: int
    decode_only: bool
