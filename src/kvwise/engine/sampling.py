"""`SamplingParams` and the sampler: one batched step from logits to next tokens.

The parameters follow vLLM's offline API (`temperature`, `top_p`, `top_k`, `min_p`, `seed`,
`stop`, `stop_token_ids`, `max_tokens`, `n`, `logprobs`, and the penalties), so users feel at home.
A temperature of 0 is greedy. Each request with a seed samples from its own generator, so its
output does not depend on what else is in the batch.

Penalties change the logits before anything else (greedy included), as in vLLM:
- `repetition_penalty` (transformers' and CTRL's): a token already in the prompt or the output has
  its logit divided by the penalty when positive, multiplied when negative;
- `frequency_penalty` and `presence_penalty` (OpenAI's): a token's logit loses frequency x its count
  in the output so far, and presence once if it occurs there at all.
`min_p` then drops tokens whose probability, after temperature, is under min_p x the top one's.
Logprobs are reported from the model's logits, before any of this (vLLM's default).
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
    # log-probabilities of the prompt's own tokens (each given the ones before it, under the
    # request's KV as it stands when it is read), with this many top alternatives; vLLM's field
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)  # sampling one of these ends the output

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
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
            ),
            (all(isinstance(text, str) and text for text in self.stop), "stop must be non-empty strings"),
            (len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"),
            (
                all(len(text) <= MAX_STOP_LENGTH for text in self.stop),
                f"a stop string may have at most {MAX_STOP_LENGTH} characters",
            ),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (
                math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10,
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}",
            ),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                all(isinstance(token, int) and token >= 0 for token in self.stop_token_ids),
                "stop_token_ids must be non-negative token ids",
            ),
            (len(self.stop_token_ids) <= 64, f"at most 64 stop_token_ids, got {len(self.stop_token_ids)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def stops_at(self, token: int, eos: int | None) -> bool:
        """Whether sampling `token` ends the output: EOS (unless ignored) or a stop token id."""
        return (token == eos and eos is not None and not self.ignore_eos) or token in self.stop_token_ids

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0


def prompt_token_logprobs(logits: torch.Tensor, targets: list[int], top: int) -> tuple[list[dict[int, float]], list]:
    """logits [n, vocab] after n prompt positions, targets: the n tokens that follow them -> per
    position, the target's log-probability and the `top` likeliest tokens' (target first), and
    the target's rank in the vocabulary (1: the likeliest)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    chosen_values = log_probs[torch.arange(len(targets)), torch.tensor(targets, device=logits.device)]
    ranks = ((log_probs > chosen_values[:, None]).sum(dim=-1) + 1).tolist()
    chosen = chosen_values.tolist()
    best = log_probs.topk(top, dim=-1) if top else None
    entries = []
    for row, (target, value) in enumerate(zip(targets, chosen)):
        entry = {target: value}
        if best is not None:
            entry.update(zip(best.indices[row].tolist(), best.values[row].tolist()))
        entries.append(entry)
    return entries, ranks


@dataclass
class SampledToken:
    token: int
    logprob: float
    top: dict[int, float]  # the `logprobs` most likely tokens and their log-probabilities


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: list[tuple[list[int], list[int]]] | None = None,
):
    """Pick one token per row.

    Args:
        logits: [batch, vocab], the last position of each running sequence.
        params, generators: one per row; a generator (on the logits' device) makes that row's
            draw reproducible whatever else is in the batch.
        histories: one (prompt token ids, output token ids) per row, for the penalties.
    Returns:
        list of SampledToken, one per row.
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    chosen = []
    for row, (settings, generator) in enumerate(zip(params, generators)):
        scores = logits[row]
        if settings.penalized:
            if histories is None:
                raise ValueError("penalties need each row's prompt and output")
            scores = apply_penalties(scores, settings, *histories[row])
        if settings.greedy:
            token = int(torch.argmax(scores))
        else:
            token = _draw(scores.float() / settings.temperature, settings, generator)
        top = {}
        if settings.logprobs:
            values, indices = log_probs[row].topk(settings.logprobs)
            top = dict(zip(indices.tolist(), values.tolist()))
        chosen.append(SampledToken(token, float(log_probs[row, token]), top))
    return chosen


def apply_penalties(
    logits: torch.Tensor, settings: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """logits [vocab] after the repetition, frequency and presence penalties (a new tensor)."""
    logits = logits.float().clone()
    if settings.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*prompt, *output}), dtype=torch.long, device=logits.device)
        picked = logits[seen]
        penalty = settings.repetition_penalty
        logits[seen] = torch.where(picked < 0, picked * penalty, picked / penalty)
    if output and (settings.frequency_penalty or settings.presence_penalty):
        tokens, counts = torch.tensor(output, device=logits.device).unique(return_counts=True)
        logits[tokens] -= settings.frequency_penalty * counts + settings.presence_penalty
    return logits


def min_p_cut(scaled: torch.Tensor, min_p: float) -> torch.Tensor:
    """Temperature-scaled logits [vocab] with tokens under min_p x the top probability set to -inf."""
    probs = torch.softmax(scaled, dim=-1)
    return scaled.masked_fill(probs < min_p * probs.max(), float("-inf"))


def _draw(scaled: torch.Tensor, settings: SamplingParams, generator: torch.Generator | None) -> int:
    """Sample from temperature-scaled logits [vocab] after min-p, top-k and top-p cuts."""
    if settings.min_p > 0:
        scaled = min_p_cut(scaled, settings.min_p)
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
