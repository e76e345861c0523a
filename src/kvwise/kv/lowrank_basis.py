"""Per-head bases of a model's keys and values, for the low-rank codec (`lowrank:r=16+kivi4`).

For every layer and KV head, the mean and the principal directions of the rows the cache stores
(keys after RoPE, values), from `kvwise calibrate` on text no bench scores on. A row is then held
as its first r coordinates in that basis. The bases are the model's, like its weights: one copy
serves every context, so they are not counted in a context's bytes.

Keys are taken after RoPE, as the cache holds them. Before RoPE they are lower-rank (Palu and
ShadowKV project there), but restoring them would need each kept token's position at every read,
and evicting caches keep no positions; after RoPE the codec commutes with eviction and with any
rotary layout.

The file is safetensors named by the weights' fingerprint: per layer, "keys.mean" [heads,
head_dim], "keys.basis" [heads, head_dim, head_dim] (columns by decreasing variance), and the
same for "values".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvwise.util.calibrated import calibrated_path, find_calibrated, load_layered, save_layered

SUFFIX = ".lowrank.safetensors"
ROLES = ("keys", "values")


@dataclass
class LowRankBasis:
    """fingerprint: the weights it was calibrated on; layers: layer_idx -> tensors (see the module);
    info: calibration text, tokens, held-out relative error per rank."""

    fingerprint: str
    layers: dict[int, dict[str, torch.Tensor]]
    info: dict = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return next(iter(self.layers.values()))["keys.mean"].shape[-1]

    def flat(self, role: str, rank: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """Every (layer, head) of `role` in one table: mean [num_bases, head_dim], basis
        [num_bases, head_dim, rank], and the first row of each layer (layer l, head h is row
        starts[l] + h)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if not 1 <= rank <= self.head_dim:
            raise ValueError(f"the rank r must be in [1, head_dim={self.head_dim}], got {rank}")
        order = sorted(self.layers)
        if order != list(range(len(order))):
            raise ValueError(f"the low-rank basis lacks layers: it has {order}")
        means = [self.layers[index][f"{role}.mean"].float() for index in order]
        bases = [self.layers[index][f"{role}.basis"][..., :rank].float() for index in order]
        starts = tuple(int(sum(mean.shape[0] for mean in means[:index])) for index in range(len(means)))
        return torch.cat(means), torch.cat(bases), starts

    def save(self, path: str | Path) -> Path:
        return save_layered(path, self.fingerprint, self.layers, self.info)

    @classmethod
    def load(cls, path: str | Path) -> LowRankBasis:
        fingerprint, layers, info = load_layered(path, "a low-rank basis")
        wanted = {f"{role}.{part}" for role in ROLES for part in ("mean", "basis")}
        if not layers or any(set(tensors) != wanted for tensors in layers.values()):
            raise ValueError(f"{path} is not a low-rank basis: a layer lacks its means or bases")
        return cls(fingerprint, layers, info)


def user_basis_path(fingerprint: str) -> Path:
    """Where `kvwise calibrate` writes a model's bases (beside its profile)."""
    return calibrated_path(fingerprint, SUFFIX)


def find_basis(fingerprint: str, path: str | Path | None = None) -> LowRankBasis | None:
    return find_calibrated(fingerprint, SUFFIX, LowRankBasis.load, "the low-rank basis {path} was calibrated", path)


def require_basis(model) -> LowRankBasis:
    """The bases of `model`'s weights, or a ValueError naming the command that makes them."""
    from kvwise.util.fingerprint import weights_fingerprint

    fingerprint = weights_fingerprint(model)
    basis = find_basis(fingerprint)
    if basis is None:
        raise ValueError(
            f"the lowrank quantizer needs this model's key and value bases (weights {fingerprint}); "
            "run `kvwise calibrate --model <it>` first (it fits them in seconds)"
        )
    return basis
