"""Train kvzap's score surrogate on a model: hidden states -> KVzip's reconstruction scores.

For each training passage, KVzip compresses it once through the library cache while hooks record
every layer's attention input during the prefill; the scores KVzip's reconstruction pass gives
each (layer, KV head, token) are the targets, as logs. One small head per layer is then fitted:
a ridge regression (closed form) or a two-layer MLP (Adam, minutes on a CPU). Passages are drawn
from the calibration text (by default the built-in essays kept apart from every bench), and the
last ones are held out to measure agreement: the share of the entries KVzip keeps at a ratio that
the surrogate keeps too.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass

import torch
from tqdm import tqdm

from kvwise.hf.attention_inputs import attention_modules
from kvwise.hf.cache import KVWiseCache
from kvwise.hf.chat_template import bos_ids, has_chat_template
from kvwise.policies.base import PROTECTED
from kvwise.policies.kvzip import KVzipPolicy, _chat_head_and_suffix
from kvwise.policies.score_surrogate import ScoreSurrogate
from kvwise.policies.selection import select_across_layers
from kvwise.util.fingerprint import weights_fingerprint

log = logging.getLogger("kvwise.calibrate")

FLOOR = 1e-6  # scores below this are one class: "never kept"
AGREEMENT_RATIOS = (0.75, 0.9, 0.95)


@dataclass
class SurrogateConfig:
    passages: int = 12  # training passages; `held_out` more measure agreement
    held_out: int = 2
    passage_tokens: tuple[int, int] = (1000, 2000)
    kind: str = "linear"  # "linear" (ridge, closed form) or "mlp"; on SmolLM2 the MLP agreed no better
    width: int = 128
    steps: int = 400
    seed: int = 0

    def __post_init__(self):
        if self.kind not in ("mlp", "linear"):
            raise ValueError(f"surrogate kind must be 'mlp' or 'linear', got {self.kind!r}")
        if self.passages < 1 or self.held_out < 0:
            raise ValueError("the surrogate needs at least one training passage")


@dataclass
class Sample:
    """One passage: per compressing layer, features [tokens, hidden] and log targets [tokens, kv_heads]."""

    features: dict[int, torch.Tensor]
    targets: dict[int, torch.Tensor]
    usable: torch.Tensor  # [tokens] bool: re-read and not a sink


def passages(tokenizer, text: str, config: SurrogateConfig, max_positions: int | None = None) -> list[list[int]]:
    """Context token ids as the benches build them: the chat head (or BOS) and a passage, short
    enough for KVzip's pass within `max_positions`."""
    stream = tokenizer(text, add_special_tokens=False).input_ids
    head = _chat_head_and_suffix(tokenizer)[0] if has_chat_template(tokenizer) else bos_ids(tokenizer)
    rng = random.Random(config.seed)
    fewest, most = config.passage_tokens
    if max_positions is not None:  # KVzip's pass reads the context twice, after the context itself
        most = min(most, (max_positions - 64) // 2 - len(head))
        fewest = min(fewest, most)
        if most < 16:
            raise ValueError(f"the model's {max_positions} positions leave no room for KVzip's pass over a passage")
    total = config.passages + config.held_out
    if len(stream) < most + 1:
        raise ValueError(f"the calibration text has {len(stream)} tokens; the surrogate needs more than {most}")
    out = []
    for _ in range(total):
        length = rng.randint(fewest, most)
        start = rng.randint(0, len(stream) - length)
        out.append(head + stream[start : start + length])
    return out


@torch.no_grad()
def collect(model, tokenizer, context_ids: list[int]) -> Sample:
    """Run KVzip on one context and record each layer's attention input and KVzip's scores."""
    policy = KVzipPolicy()
    cache = KVWiseCache(model, policy=policy, compression_ratio=0.5, tokenizer=tokenizer)
    features: dict[int, torch.Tensor] = {}
    scores: dict[int, torch.Tensor] = {}

    def record(module, args, kwargs):
        if module.layer_idx not in features:  # the prefill; the reconstruction pass comes second
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            features[module.layer_idx] = hidden[0].float().cpu()

    select = cache.finalize_global_selection

    def record_scores():
        for layer in cache.compressing_layers:
            scores[layer.layer_idx] = layer.context_scores[0].float().cpu()  # [kv_heads, tokens]
        select()

    cache.finalize_global_selection = record_scores
    hooks = [module.register_forward_pre_hook(record, with_kwargs=True) for module in attention_modules(model)]
    try:
        cache.compress_context(torch.tensor([context_ids], device=model.device))
    finally:
        for hook in hooks:
            hook.remove()
    if not scores:
        raise ValueError("KVzip produced no scores: the model has no full-attention layer to compress")
    first = next(iter(scores.values()))
    reread = torch.arange(first.shape[-1]) >= policy.reread_start
    usable = reread & (first[0] < PROTECTED / 2)
    targets = {index: s.clamp(FLOOR, 1.0).log().T for index, s in scores.items()}  # [tokens, kv_heads]
    return Sample({index: features[index] for index in scores}, targets, usable)


def fit_layer(features: torch.Tensor, targets: torch.Tensor, config: SurrogateConfig) -> dict[str, torch.Tensor]:
    """One layer's head from features [n, hidden] to log targets [n, kv_heads]."""
    mean = features.mean(dim=0)
    scale = features.std(dim=0).clamp(min=1e-4)
    x = (features - mean) / scale
    if config.kind == "linear":
        ridge = 1.0 * x.shape[0] / 1000
        design = torch.cat([x, torch.ones(x.shape[0], 1)], dim=1).double()
        gram = design.T @ design + ridge * torch.eye(design.shape[1], dtype=torch.float64)
        solution = torch.linalg.solve(gram, design.T @ targets.double()).float()
        return {"mean": mean, "scale": scale, "w1": solution[:-1].contiguous(), "b1": solution[-1].contiguous()}
    generator = torch.Generator().manual_seed(config.seed)
    hidden, outputs = x.shape[1], targets.shape[1]
    w1 = (torch.randn(hidden, config.width, generator=generator) / math.sqrt(hidden)).requires_grad_()
    b1 = torch.zeros(config.width, requires_grad=True)
    w2 = torch.zeros(config.width, outputs, requires_grad=True)
    b2 = targets.mean(dim=0).clone().requires_grad_()
    optimizer = torch.optim.Adam([w1, b1, w2, b2], lr=3e-3)
    batch = min(4096, x.shape[0])
    with torch.enable_grad():
        for _ in range(config.steps):
            rows = torch.randint(0, x.shape[0], (batch,), generator=generator)
            predicted = torch.nn.functional.gelu(x[rows] @ w1 + b1) @ w2 + b2
            loss = torch.nn.functional.mse_loss(predicted, targets[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return {
        name: tensor.detach()
        for name, tensor in {"mean": mean, "scale": scale, "w1": w1, "b1": b1, "w2": w2, "b2": b2}.items()
    }


def train_surrogate(
    model, tokenizer, text: str, description: str, config: SurrogateConfig | None = None
) -> ScoreSurrogate:
    """Collect KVzip's scores on passages of `text`, fit one head per layer, measure agreement."""
    config = config or SurrogateConfig()
    max_positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    contexts = passages(tokenizer, text, config, max_positions)
    return fit_surrogate(model, tokenizer, contexts, description, config)


def fit_surrogate(
    model, tokenizer, contexts: list[list[int]], description: str, config: SurrogateConfig
) -> ScoreSurrogate:
    """The surrogate of `model` from context token ids: the first `config.passages` train it, the
    rest measure its agreement with KVzip."""
    samples = [collect(model, tokenizer, ids) for ids in tqdm(contexts, desc="kvzap surrogate", unit="passage")]
    train, held_out = samples[: config.passages], samples[config.passages :]
    layers = {}
    for index in train[0].features:
        features = torch.cat([sample.features[index][sample.usable] for sample in train])
        targets = torch.cat([sample.targets[index][sample.usable] for sample in train])
        layers[index] = fit_layer(features, targets, config)
    surrogate = ScoreSurrogate(weights_fingerprint(model), layers)
    agreements = {str(ratio): agreement(surrogate, held_out, ratio) for ratio in AGREEMENT_RATIOS} if held_out else {}
    surrogate.info = {
        "data": description,
        "kind": config.kind,
        "width": config.width if config.kind == "mlp" else None,
        "training_passages": len(train),
        "training_tokens": int(sum(int(sample.usable.sum()) for sample in train)),
        "agreement": agreements,
    }
    log.info("kvzap surrogate: agreement with KVzip's kept set %s", agreements)
    return surrogate


def agreement(surrogate: ScoreSurrogate, samples: list[Sample], ratio: float) -> float:
    """Share of the (layer, head, token) entries KVzip keeps at `ratio` that the surrogate keeps too,
    over `samples` (sinks and the chat head left out of both counts)."""
    policy = KVzipPolicy()
    shared = kept = 0
    for sample in samples:
        order = sorted(sample.targets)
        truth = torch.stack([sample.targets[index].T for index in order])[None]  # [1, layers, heads, tokens]
        guess = torch.stack([surrogate.log_scores(index, sample.features[index][None])[0] for index in order])[None]
        valid = sample.usable.expand_as(truth[0]).clone()[None]
        truth_keep = select_across_layers(policy, ratio, truth.exp(), valid)
        guess_keep = select_across_layers(policy, ratio, guess.exp(), valid)
        shared += int((truth_keep & guess_keep).sum())
        kept += int(truth_keep.sum())
    return round(shared / max(kept, 1), 4)
