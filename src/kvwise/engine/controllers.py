"""Controllers that choose the KV mix of `auto` requests, built by name.

The engine knows what a controller does (`EngineCore.attach_controller`), not how one is made:
the adaptive layer above registers its factory here when `kvwise` is imported, so `LLM(kv="auto")`
and `kvwise serve` build theirs through one function without the engine importing upwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_FACTORIES: dict[str, Callable[..., Any]] = {}


def register_controller(name: str, factory: Callable[..., Any]) -> None:
    """Make `build_controller(name, model, ...)` call `factory(model, ...)`."""
    _FACTORIES[name] = factory


def build_controller(name: str, model, **options) -> Any:
    """The controller registered as `name` for `model`; ValueError naming the known ones otherwise."""
    factory = _FACTORIES.get(name)
    if factory is None:
        known = ", ".join(sorted(_FACTORIES)) or "none (import kvwise first)"
        raise ValueError(f"no KV controller named {name!r}; known: {known}")
    return factory(model, **options)
