"""What the controller's actions cost on this machine, and what they are worth.

A decode step's time is modelled as a line in the requests it serves:

    step seconds = scale x (base + sum over requests of (per_request[form] + per_byte[form] x held bytes))

- base: what a step costs with no request in it (reading the weights, launching the layers);
- per_request[form]: what one more request adds besides its KV (its token through the linear
  layers, its group in attention, restoring a quantized layer);
- per_byte[form]: what each byte of KV it holds adds (reading it, dequantizing it);
- scale: the online correction, a moving average of measured over predicted step time on the
  engine's decode-only steps, so a busy or faster machine moves the model without a recalibration.

A form is how a request holds its KV: `full`, `evicted` (head pages of an eviction), or a
quantizer's name (`int8`, `kivi4`, ...); `kvwise calibrate` measures each (`cost_calibration`).

An action is worth doing when the tokens it gains over a horizon beat the tokens it costs:
- it gains by letting held-back requests run now: throughput goes from n / T(n) to
  (n + k) / T(n + k), only for the horizon over which memory would not free by itself (until
  enough running requests finish to admit the first held-back one in full);
- it costs its one-time seconds (a quantization, a context pass), during which the n running
  requests make no progress, any slower step it leaves behind (inside T(n + k) over the horizon),
  and the slower steps it still leaves after the horizon, until the request it changed ends
  (`tail_seconds`): past the horizon the held-back requests would have run anyway.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

SCALE_BOUNDS = (0.25, 4.0)  # one odd step (a page fault, another process) moves the scale at most this far


@dataclass(frozen=True)
class FormCost:
    """What one decoding request in a KV form adds to a step: per_request seconds, and
    per_byte seconds for each KV byte it holds."""

    per_request: float
    per_byte: float


@dataclass
class MachineCosts:
    """Measured costs of one model on one machine (`kvwise calibrate`). machine: the CPU (or GPU)
    and its speed-relevant flags; dtype: the model's, as measured."""

    machine: str
    dtype: str
    base: float  # seconds of a decode step with no request in it
    forms: dict[str, FormCost]
    prefill_seconds_per_token: float  # a context pass (a KVzip reconstruction, a recompute)

    def __post_init__(self):
        self.forms = {name: c if isinstance(c, FormCost) else FormCost(**c) for name, c in self.forms.items()}
        if "full" not in self.forms:
            raise ValueError("machine costs must measure the 'full' form, the fallback of every other")
        if self.base < 0 or self.prefill_seconds_per_token < 0:
            raise ValueError("machine costs are seconds: none may be negative")

    def form(self, name: str) -> FormCost:
        """A form's cost; one not measured costs what `full` does."""
        return self.forms.get(name) or self.forms["full"]

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Holder:
    """One decoding request as the cost model sees it: its form and the KV bytes it holds."""

    form: str
    held_bytes: int


@dataclass(frozen=True)
class Verdict:
    """An action's worth in output tokens over the horizon: it pays when gain > cost."""

    gain_tokens: float
    cost_tokens: float

    @property
    def pays(self) -> bool:
        return self.gain_tokens > self.cost_tokens


@dataclass
class CostModel:
    costs: MachineCosts
    smoothing: float = 0.1  # weight of each new measured step in the moving average
    scale: float = 1.0
    observed_steps: int = field(default=0)

    def step_seconds(self, holders: list[Holder]) -> float:
        """Predicted seconds of one decode step serving `holders`."""
        total = self.costs.base
        for holder in holders:
            cost = self.costs.form(holder.form)
            total += cost.per_request + cost.per_byte * holder.held_bytes
        return self.scale * total

    def observe(self, holders: list[Holder], seconds: float) -> None:
        """Correct the model with a decode-only step the engine measured."""
        predicted = self.step_seconds(holders) / self.scale
        if not holders or predicted <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        ratio = min(max(seconds / predicted, SCALE_BOUNDS[0]), SCALE_BOUNDS[1])
        self.scale += self.smoothing * (ratio - self.scale)
        self.observed_steps += 1

    def verdict(
        self,
        running: list[Holder],
        after: list[Holder],
        admitted: list[Holder],
        one_time_seconds: float,
        horizon_steps: float,
        tail_seconds: float = 0.0,
    ) -> Verdict:
        """Tokens gained and lost if an action turns the decoding `running` into `after` (the same
        requests, some in a new form) and lets `admitted` held-back requests run now, at a cost of
        `one_time_seconds`, over `horizon_steps` steps of the running requests; `tail_seconds`:
        the extra step seconds (as `step_seconds` predicts them) the action still costs after the
        horizon, all steps together."""
        now = self.step_seconds(running)
        then = self.step_seconds(after + admitted)
        if now <= 0 or then <= 0:
            return Verdict(0.0, math.inf)
        rate_now = len(running) / now
        rate_then = (len(after) + len(admitted)) / then
        horizon = horizon_steps * now  # seconds until memory frees by itself
        gained = max(0.0, rate_then - rate_now) * horizon
        lost = rate_now * (one_time_seconds + max(0.0, tail_seconds))
        lost += max(0.0, rate_now - rate_then) * horizon
        return Verdict(gained, lost)
