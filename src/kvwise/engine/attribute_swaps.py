"""Attributes replaced while the runner's forward runs (a module's `forward`, a modeling file's
function), counted per (object, name) under a lock: two runners on one model, or two models of
one family, may run at once and enter and leave in any order, and the original comes back when
the last of them ends."""

from __future__ import annotations

import threading

ABSENT = object()


class AttributeSwaps:
    """What is replaced now, and for how many forwards."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: dict = {}  # (id(target), name) -> [count, target, what vars(target) held]

    def enter(self, target, name: str, replacement, expected) -> bool:
        """Put `replacement` in place if `target` still holds `expected` there (`ABSENT`: nothing
        of its own), or count one more user of the replacement in place; False: left alone."""
        with self._lock:
            key = (id(target), name)
            held = self._held.get(key)
            if held is None:
                current = vars(target).get(name, ABSENT)
                if current is not expected:
                    return False
                held = self._held[key] = [0, target, current]
                setattr(target, name, replacement)
            held[0] += 1
            return True

    def leave(self, target, name: str) -> None:
        with self._lock:
            key = (id(target), name)
            held = self._held[key]
            held[0] -= 1
            if held[0]:
                return
            del self._held[key]
            if held[2] is ABSENT:
                delattr(target, name)
            else:
                setattr(target, name, held[2])


swaps = AttributeSwaps()
