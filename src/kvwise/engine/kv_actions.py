"""What a KV controller may ask of the engine, and what came of it.

A controller (`engine/controllers.py`; the adaptive one in `adaptive/`) never touches requests or
KV memory itself: it reads a `ControllerView` and answers with these actions, which the
`KVCacheManager` carries out (`KVCacheManager.execute`). The view of the next step brings back
each action's `Outcome`: what it freed, or why it could not run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: the request module is below this one's callers
    from kvwise.engine.request import Request


@dataclass(frozen=True, eq=False)
class AssignMix:
    """Give `request` the KV mix `mix` (a spec); `label` becomes its `kv_choice` (the controller's
    record of why, opaque to the engine). quantize_now: store its settled blocks quantized at once
    (a quantizer-only mix on a running request); an evicting mix runs at the request's next step."""

    request: Request
    mix: str
    label: object = None
    quantize_now: bool = False
    kind: str = "choose"  # the controller's name for the action, for its log
    reason: str = ""


@dataclass(frozen=True)
class SpillPrefixes:
    """Move up to `blocks` cold prefix-cache blocks off the device (to the tiers, when any)."""

    blocks: int
    kind: str = "spill"
    reason: str = ""


Action = AssignMix | SpillPrefixes


@dataclass(frozen=True)
class KVChange:
    """A mix a controller gave a request (`Request.kv_changes`), and when: `at` tokens of it were
    in KV memory then (0: at admission), so a scorer can make the same change at the same token
    (`bench/engine_scoring.py`)."""

    at: int
    mix: str
    quantize_now: bool = False


@dataclass(frozen=True)
class Outcome:
    """What one action did: bytes held before and freed at once (an eviction frees on the
    request's next step, so 0 here), or the error that stopped it (nothing changed then)."""

    action: Action
    bytes_before: int = 0
    freed_bytes: int = 0
    error: str | None = None
