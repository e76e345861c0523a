"""`StepProfile`: where the engine's step time goes, while a bench profiles it.

Parts, in seconds summed over the steps profiled:

    linear.prefill, linear.decode   the model's `nn.Linear` calls (projections, MLP, LM head),
                                    split between a step's prefill and decode tokens in proportion
                                    to their count
    attention.prefill, .decode      kvwise's paged attention, timed per group of the step
    other model ops                 the rest of the forward: embeddings, norms, rotary, activations
    sampling
    detokenizing                    stop strings and each finished request's text
    engine Python                   the rest of the step: scheduling, block tables and inputs,
                                    settling memory, bookkeeping

Timers, not a sampling profiler: `perf_counter` around each part (after a CUDA synchronize on
a GPU), so the parts add up to the step's wall time and cost a few microseconds each. They run
only while a profile is attached (`EngineCore.profile`); the hooks on every `nn.Linear` are
added then and removed after. The split of linear time by token count is an approximation: a
decode token costs a linear layer as much compute as a prefill token, but a step of decodes
alone is mostly reading the weights.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

PARTS = (
    "linear.prefill",
    "linear.decode",
    "attention.prefill",
    "attention.decode",
    "other model ops",
    "sampling",
    "detokenizing",
    "engine Python",
)


class StepProfile:
    def __init__(self, device: torch.device | str = "cpu"):
        """device: the model's; on CUDA each timer waits for the work queued before it reads the
        clock (kernels run asynchronously, so a bare clock would time their launches)."""
        self.synchronize = torch.cuda.synchronize if torch.device(device).type == "cuda" else _nothing
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.tokens = {"prefill": 0, "decode": 0}
        self._step_linear = 0.0
        self._step_attention = 0.0
        self._hooks: list = []

    def now(self) -> float:
        self.synchronize()
        return time.perf_counter()

    @contextmanager
    def timing(self, part: str):
        started = self.now()
        try:
            yield
        finally:
            self.seconds[part] += self.now() - started

    @contextmanager
    def step(self):
        """Around one engine step: what no part claims is the engine's own Python."""
        started = self.now()
        before = sum(self.seconds.values())
        try:
            yield
        finally:
            claimed = sum(self.seconds.values()) - before
            self.seconds["engine Python"] += self.now() - started - claimed
            self.steps += 1

    @contextmanager
    def forward(self, prefill_tokens: int, decode_tokens: int):
        """Around the model's forward: its linear time is split by the step's tokens, and what
        neither linear layers nor attention took is the other model ops."""
        self._step_linear = self._step_attention = 0.0
        started = self.now()
        try:
            yield
        finally:
            total = self.now() - started
            tokens = max(prefill_tokens + decode_tokens, 1)
            self.seconds["linear.prefill"] += self._step_linear * prefill_tokens / tokens
            self.seconds["linear.decode"] += self._step_linear * decode_tokens / tokens
            self.seconds["other model ops"] += total - self._step_linear - self._step_attention
            self.tokens["prefill"] += prefill_tokens
            self.tokens["decode"] += decode_tokens

    @contextmanager
    def attention(self, decode: bool):
        part = "attention.decode" if decode else "attention.prefill"
        before = self.seconds[part]
        try:
            with self.timing(part):
                yield
        finally:  # a step that fails still splits its forward's time right
            self._step_attention += self.seconds[part] - before

    def attach_linear_hooks(self, model: torch.nn.Module) -> None:
        """Time every nn.Linear of `model` (removed by `detach`)."""
        started: dict[int, float] = {}

        def before(module, args):
            started[id(module)] = self.now()

        def after(module, args, output):
            self._step_linear += self.now() - started.pop(id(module))

        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                self._hooks += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def summary(self) -> dict:
        """Seconds and share of the profiled steps' time per part, in `PARTS` order."""
        total = sum(self.seconds.values())
        parts = {
            part: {"seconds": self.seconds.get(part, 0.0), "share": self.seconds.get(part, 0.0) / (total or 1.0)}
            for part in PARTS
        }
        return {"steps": self.steps, "seconds": total, "tokens": dict(self.tokens), "parts": parts}


def _nothing() -> None:
    pass
