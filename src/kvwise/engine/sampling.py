"""`SamplingParams` and the sampler: one batched step from logits to next tokens.

The parameters follow vLLM's offline API (`temperature`, `top_p`, `top_k`, `seed`, `stop`,
`max_tokens`, `n`, `logprobs`), so users feel at home. A temperature of 0 is greedy. Each
request with a seed samples from its own generator, so its output does not depend on what else
is in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Below this temperature sampling is greedy: logits / T would overflow float32 (vLLM's epsilon)
GREEDY_BELOW = 1e-5
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256  # characters of one stop string


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    logprobs: int | None = None  # how many top alternatives to report per token (0: only the chosen one)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (
                math.isfinite(self.temperature) and self.temperature >= 0,
                f"temperature must be a finite number >= 0, got {self.temperature}",
            ),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1, 0 or positive, got {self.top_k}"),
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.seed is None or 0 <= self.seed < 2**63 - 1024, f"seed must be in [0, 2**63), got {self.seed}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (all(isinstance(text, str) and text for text in self.stop), "stop must be non-empty strings"),
            (len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"),
            (
                all(len(text) <= MAX_STOP_LENGTH for text in self.stop),
                f"a stop string may have at most {MAX_STOP_LENGTH} characters",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass
class SampledToken:
    token: int
    logprob: float
    top: dict[int, float]  # the `logprobs` most likely tokens and their log-probabilities


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]):
    """Pick one token per row.

    Args:
        logits: [batch, vocab], the last position of each running sequence.
        params, generators: one per row; a generator (on the logits' device) makes that row's
            draw reproducible whatever else is in the batch.
    Returns:
        list of SampledToken, one per row.
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    chosen = []
    for row, (settings, generator) in enumerate(zip(params, generators)):
        if settings.greedy:
            token = int(torch.argmax(logits[row]))
        else:
            token = _draw(logits[row].float() / settings.temperature, settings, generator)
        top = {}
        if settings.logprobs:
            values, indices = log_probs[row].topk(settings.logprobs)
            top = dict(zip(indices.tolist(), values.tolist()))
        chosen.append(SampledToken(token, float(log_probs[row, token]), top))
    return chosen


def _draw(scaled: torch.Tensor, settings: SamplingParams, generator: torch.Generator | None) -> int:
    """Sample from temperature-scaled logits [vocab] after top-k and top-p cuts."""
    if settings.top_k > 0 and settings.top_k < scaled.numel():
        threshold = scaled.topk(settings.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    if settings.top_p < 1.0:
        ordered, order = scaled.sort(descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = cumulative - torch.softmax(ordered, dim=-1) >= settings.top_p
        scaled = scaled.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if not bool(torch.isfinite(probs).all()):  # logits that were not finite: never fail the batch's step
        return int(torch.nan_to_num(scaled, nan=float("-inf")).argmax())
    return int(torch.multinomial(probs, 1, generator=generator))  # a generator lives on the logits' device


def find_stop(text: str, stops: list[str], start: int = 0) -> int | None:
    """Where the first stop string begins in `text` (searching from `start`), or None."""
    positions = [text.find(stop, start) for stop in stops]
    found = [position for position in positions if position >= 0]
    return min(found) if found else None
