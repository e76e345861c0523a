"""A learned stand-in for KVzip's scores: per layer, a token's hidden state -> the log of the score
KVzip's reconstruction pass would give it, one output per KV head.

`kvwise calibrate` trains one per model (`adaptive.surrogate_training`) and stores it beside the
model's profile, named by the weights' fingerprint; the one for the embedded model ships with the
package. The file is safetensors: per layer, input standardization and one or two dense layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvwise.util.calibrated import calibrated_path, find_calibrated, load_layered, save_layered

SUFFIX = ".kvzap.safetensors"


@dataclass
class ScoreSurrogate:
    """Per-layer score predictors.

    layers: layer_idx -> tensors: "mean", "scale" [hidden_size] (standardization), "w1"
        [hidden_size, width], "b1" [width], and for a two-layer MLP "w2" [width, num_kv_heads],
        "b2" [num_kv_heads] (a linear surrogate has width = num_kv_heads and no w2).
    info: how it was trained (data, tokens, agreement with KVzip), for reports.
    """

    fingerprint: str
    layers: dict[int, dict[str, torch.Tensor]]
    info: dict = field(default_factory=dict)

    def log_scores(self, layer_idx: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [batch, seq_len, hidden_size] -> predicted log scores [batch, num_kv_heads, seq_len]."""
        weights = self.layers.get(layer_idx)
        if weights is None:
            raise ValueError(f"the kvzap surrogate has no predictor for layer {layer_idx}")
        device = hidden_states.device
        features = (hidden_states.float() - weights["mean"].to(device)) / weights["scale"].to(device)
        out = features @ weights["w1"].to(device) + weights["b1"].to(device)
        if "w2" in weights:
            out = torch.nn.functional.gelu(out) @ weights["w2"].to(device) + weights["b2"].to(device)
        return out.transpose(1, 2)

    def save(self, path: str | Path) -> Path:
        return save_layered(path, self.fingerprint, self.layers, self.info)

    @classmethod
    def load(cls, path: str | Path) -> ScoreSurrogate:
        return cls(*load_layered(path, "a kvzap surrogate"))


def user_surrogate_path(fingerprint: str) -> Path:
    """Where `kvwise calibrate` writes a model's surrogate (beside its profile)."""
    return calibrated_path(fingerprint, SUFFIX)


def find_surrogate(fingerprint: str, path: str | Path | None = None) -> ScoreSurrogate | None:
    """`path` if given, else the user's (from `kvwise calibrate`), else the shipped one; None if none."""
    return find_calibrated(fingerprint, SUFFIX, ScoreSurrogate.load, "the kvzap surrogate {path} was trained", path)
