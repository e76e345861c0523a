"""The manager's side of the controller protocol: the view a controller reads before each step
and the execution of the actions it answers with (`kv_actions`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvwise.engine.block_table import Place
from kvwise.engine.kv_actions import Action, AssignMix, KVChange, Outcome, SpillPrefixes
from kvwise.engine.kv_settings import resolve
from kvwise.engine.kv_view import ControllerView, LastStep, RunningRequest

if TYPE_CHECKING:  # types only: the manager imports this module
    from kvwise.engine.kv_manager import KVCacheManager
    from kvwise.engine.request import Request


def controller_view(
    kv: KVCacheManager,
    running: Sequence[Request] = (),
    stalls: tuple[int, int] = (0, 0),
    outcomes: Sequence[Outcome] = (),
    held_back: Sequence[Request] = (),
    last_step: LastStep | None = None,
    admitting: Request | None = None,
) -> ControllerView:
    """stalls: the scheduler's (memory stalls, preemptions) so far; held_back: the waiting
    requests (running ones still prefilling are found in `running`); admitting: the request an
    admission view is for (its document's cached length is peeked at, device and tiers)."""
    document_cached = 0
    if admitting is not None and admitting.compress_upto is not None:
        document_cached = min(kv.cached_length(admitting, tiers=True), admitting.compress_upto)
    return ControllerView(
        usage=kv.usage(),
        free_blocks=kv.free_blocks(),
        num_blocks=kv.num_blocks,
        block_size=kv.block_size,
        block_bytes=kv.block_bytes,
        has_tiers=kv.has_tiers,
        memory_stalls=stalls[0],
        preemptions=stalls[1],
        swapped_out_blocks=kv.swapped_out_blocks,
        recomputed_blocks=kv.recomputed_blocks,
        quantization_errors=kv.quantization_errors(),
        running=tuple(_running(kv, request) for request in running),
        outcomes=tuple(outcomes),
        held_back_tokens=tuple(
            len(request.prompt) + request.params.max_tokens - request.computed
            for request in (*held_back, *running)
            if request.prefilling
        ),
        last_step=last_step,
        document_cached_tokens=document_cached,
    )


def _running(kv: KVCacheManager, request: Request) -> RunningRequest:
    settings = request.kv
    return RunningRequest(
        request=request,
        request_id=request.request_id,
        tokens=len(request.tokens),
        prompt_tokens=len(request.prompt),
        reused=request.reused,
        past_prefill=not request.prefilling and request.reconstruction is None,
        kv_auto=request.kv_auto,
        kv_choice=request.kv_choice,
        has_settings=settings is not None,
        evicts=settings is not None and settings.evicts,
        quantized=(settings is not None and settings.quantizer is not None) or Place.QUANTIZED in request.blocks.places,
        kept_score=request.kept_score,
        held_bytes=kv.request_bytes(request),
        has_region=request.region is not None,
        remaining_tokens=max(0, request.params.max_tokens - len(request.output)),
        kv_form=_kv_form(request),
    )


def _kv_form(request: Request) -> str:
    """How the request holds its KV, in a cost model's words."""
    settings = request.kv
    if settings is not None and settings.quant is not None:
        return settings.quant.split(":")[0]
    if request.region is not None:
        return "evicted"
    return "full"


def execute(kv: KVCacheManager, action: Action) -> Outcome:
    """Carry out one action; an action that fails changes nothing and says why."""
    if isinstance(action, SpillPrefixes):
        return Outcome(action, freed_bytes=kv.spill_cold_prefixes(action.blocks) * kv.block_bytes)
    if not isinstance(action, AssignMix):
        raise TypeError(f"not a KV action: {action!r}")
    request = action.request
    if request.done:
        return Outcome(action, error="the request has finished")
    settings, previous = resolve(action.mix), (request.kv, request.kv_choice)
    before = kv.request_bytes(request)
    kv.assign_settings(request, settings if settings.active else None)
    request.kv_choice = action.label
    if action.quantize_now:
        failed = kv.quantize_settled([request])
        if failed:  # the request keeps its blocks as they were
            kv.assign_settings(request, previous[0])
            request.kv_choice = previous[1]
            return Outcome(action, before, error=str(failed[0][1]))
    request.kv_changes.append(KVChange(request.computed, action.mix, action.quantize_now))
    return Outcome(action, before, freed_bytes=max(0, before - kv.request_bytes(request)))
