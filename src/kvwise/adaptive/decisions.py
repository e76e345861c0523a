"""What the controller did: counters by action and reason, bytes freed, predicted quality per class,
and a log of its last decisions in order, each with its reason (the bench saves it with a run).

The server's metrics read a snapshot (`counts`, `bytes_freed`, `predicted_quality`) from another
thread; every write happens on the engine's thread, so plain dicts of numbers are enough.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from dataclasses import dataclass

from kvwise.adaptive.profile import CLASSES

log = logging.getLogger("kvwise.adaptive")

LOG_LENGTH = 10_000  # decisions the log keeps, the newest (a run of equal holds is one entry)
ACTIONS = ("choose", "quantize", "compress", "spill", "swap", "preempt", "hold")  # hold: nothing paid


@dataclass(frozen=True)
class Choice:
    """The mix a request runs with, and why: returned with its response (usage.kv)."""

    mix: str
    klass: str | None
    reason: str  # spare, pressure, short, pinned, explicit, no action pays (a mix costs more than it gains)
    predicted_quality: float | None = None

    def as_usage(self) -> dict:
        usage = {"mix": self.mix, "class": self.klass, "reason": self.reason}
        if self.predicted_quality is not None:
            usage["predicted_quality"] = self.predicted_quality
        return usage


class Decisions:
    def __init__(self):
        self.counts: dict[tuple[str, str], int] = defaultdict(int)  # (action, reason) -> times
        self.bytes_freed: dict[str, int] = defaultdict(int)  # action -> bytes
        self._quality_sums = {klass: [0.0, 0] for klass in CLASSES}
        self.log: deque[dict] = deque(maxlen=LOG_LENGTH)  # {seconds, action, reason, request, freed, detail, times}
        self._started = time.monotonic()

    def record(self, action: str, reason: str, request_id: str = "", freed: int = 0, detail: str = "") -> None:
        self.counts[(action, reason)] += 1
        self.bytes_freed[action] += max(0, freed)
        last = self.log[-1] if self.log else None
        if action == "hold" and last is not None and (last["action"], last["reason"]) == (action, reason):
            last["times"] += 1  # under pressure a hold recurs every step: one entry, counted
        else:
            self.log.append(
                {
                    "seconds": round(time.monotonic() - self._started, 3),
                    "action": action,
                    "reason": reason,
                    "request": request_id,
                    "freed": max(0, freed),
                    "detail": detail,
                    "times": 1,
                }
            )
        level = logging.DEBUG if action == "hold" else logging.INFO  # a hold can recur every step under pressure
        log.log(level, "kv auto: %s (%s) %s %s freed=%d", action, reason, request_id, detail, freed)

    def record_choice(self, request_id: str, choice: Choice) -> None:
        self.record("choose", choice.reason, request_id, detail=f"class={choice.klass} mix={choice.mix}")
        if choice.klass is not None and choice.predicted_quality is not None:
            sums = self._quality_sums[choice.klass]
            sums[0] += choice.predicted_quality
            sums[1] += 1

    def predicted_quality(self) -> dict[str, float]:
        """Mean predicted quality of the requests chosen for, per class (classes without any: absent)."""
        return {klass: total / count for klass, (total, count) in self._quality_sums.items() if count}

    def total(self, action: str) -> int:
        return sum(count for (name, _), count in self.counts.items() if name == action)
