"""The Pareto front of cost against quality: one rule for `kvwise calibrate` and the benches."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

Item = TypeVar("Item")


def pareto_front(items: Iterable[Item], cost: Callable[[Item], float], quality: Callable[[Item], float]) -> list[Item]:
    """Items no other beats on both cost (lower) and quality (higher), cheapest first."""
    front, best = [], float("-inf")
    for item in sorted(items, key=lambda entry: (cost(entry), -quality(entry))):
        if quality(item) > best:
            front.append(item)
            best = quality(item)
    return front
