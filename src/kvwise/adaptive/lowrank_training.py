"""Fit the low-rank codec's bases on a model: per layer and KV head, PCA of the rows it caches.

The calibration text is cut into passages; each is prefilled once through a kvwise cache and the
keys (after RoPE) and values every layer holds are accumulated as first and second moments per
head (float64). The bases are the covariances' eigenvectors, by decreasing eigenvalue, with the
mean. The last passage is held out: the relative error of restoring its rows from the first r
coordinates, for a few r, is stored with the bases so a user can choose r before measuring.
Seconds on a CPU for a 135M model.
"""

from __future__ import annotations

import logging

import torch
from tqdm import tqdm

from kvwise.hf.cache import KVWiseCache
from kvwise.hf.chat_template import bos_ids
from kvwise.kv.lowrank_basis import ROLES, LowRankBasis
from kvwise.util.fingerprint import weights_fingerprint

log = logging.getLogger("kvwise.calibrate")

REPORTED_RANKS = (8, 16, 24, 32)
SKIPPED_HEAD_TOKENS = 4  # attention sinks: kept whole by every quantizer, and unlike other rows


@torch.no_grad()
def cached_rows(model, context_ids: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """layer -> role -> [kv_heads, tokens, head_dim] float64: what a plain kvwise cache holds after a prefill."""
    cache = KVWiseCache(model)
    try:
        model(input_ids=torch.tensor([context_ids], device=model.device), cache=cache, use_cache=True)
        rows = {}
        for index, layer in enumerate(cache.layers):
            store = getattr(layer, "store", None)
            keys, values = store.padded()[:2] if store is not None else (layer.keys, layer.values)
            rows[index] = {"keys": keys[0].double().cpu(), "values": values[0].double().cpu()}
        return rows
    finally:
        cache.restore_attention()


class _Moments:
    """Running count, sum and sum of outer products of one layer's rows, per head."""

    def __init__(self):
        self.count, self.total, self.outer = 0, None, None

    def add(self, rows: torch.Tensor) -> None:  # rows [kv_heads, tokens, head_dim]
        total, outer = rows.sum(dim=1), rows.transpose(1, 2) @ rows
        self.count += rows.shape[1]
        self.total = total if self.total is None else self.total + total
        self.outer = outer if self.outer is None else self.outer + outer

    def basis(self) -> tuple[torch.Tensor, torch.Tensor]:
        """mean [kv_heads, head_dim], basis [kv_heads, head_dim, head_dim] by decreasing variance."""
        mean = self.total / self.count
        covariance = self.outer / self.count - mean[:, :, None] * mean[:, None, :]
        _, vectors = torch.linalg.eigh(covariance)  # ascending eigenvalues
        return mean.float(), vectors.flip(-1).float()


def restore_error(basis: LowRankBasis, rows: dict[int, dict[str, torch.Tensor]], role: str, rank: int) -> float:
    """Relative error (norm of the error / norm of the rows) of restoring `rows` from r coordinates."""
    error = norm = 0.0
    for index, layer_rows in rows.items():
        mean = basis.layers[index][f"{role}.mean"].double()[:, None]
        vectors = basis.layers[index][f"{role}.basis"][..., :rank].double()
        centred = layer_rows[role] - mean
        restored = centred @ vectors @ vectors.transpose(1, 2) + mean
        error += float((restored - layer_rows[role]).pow(2).sum())
        norm += float(layer_rows[role].pow(2).sum())
    return (error / max(norm, 1e-30)) ** 0.5


def fit_basis(
    model, tokenizer, text: str, description: str, passages: int = 6, passage_tokens: int = 2048
) -> LowRankBasis:
    """Bases from `passages` consecutive passages of `text`, and their error on one more."""
    stream = tokenizer(text, add_special_tokens=False).input_ids
    head = bos_ids(tokenizer)
    max_positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None) or 1 << 30
    length = min(passage_tokens, max_positions - len(head), len(stream) // (passages + 1))
    if length < 64:
        raise ValueError(
            f"the calibration text has {len(stream)} tokens; the low-rank bases need {64 * (passages + 1)}"
        )
    contexts = [head + stream[start * length : (start + 1) * length] for start in range(passages + 1)]
    return fit_basis_on(model, contexts, description)


def fit_basis_on(model, contexts: list[list[int]], description: str) -> LowRankBasis:
    """Bases from the rows cached for every context but the last, and their error on the last."""
    moments: dict[int, dict[str, _Moments]] = {}
    for context in tqdm(contexts[:-1], desc="low-rank bases", unit="passage"):
        for index, layer_rows in cached_rows(model, context).items():
            for role in ROLES:
                moments.setdefault(index, {}).setdefault(role, _Moments()).add(
                    layer_rows[role][:, SKIPPED_HEAD_TOKENS:]
                )
    layers = {}
    for index, by_role in moments.items():
        for role, moment in by_role.items():
            mean, vectors = moment.basis()
            layers.setdefault(index, {})[f"{role}.mean"], layers[index][f"{role}.basis"] = mean, vectors
    basis = LowRankBasis(weights_fingerprint(model), layers)
    held_out = {
        index: {role: rows[role][:, SKIPPED_HEAD_TOKENS:] for role in ROLES}
        for index, rows in cached_rows(model, contexts[-1]).items()
    }
    head_dim = basis.head_dim
    errors = {
        role: {
            str(rank): round(restore_error(basis, held_out, role, rank), 4)
            for rank in REPORTED_RANKS
            if rank <= head_dim
        }
        for role in ROLES
    }
    tokens = sum(len(context) for context in contexts[:-1])
    basis.info = {"data": description, "tokens": tokens, "held_out_relative_error": errors}
    log.info("low-rank bases: held-out relative error by rank %s", errors)
    return basis
