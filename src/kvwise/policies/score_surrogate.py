"""A learned stand-in for KVzip's scores: per layer, a token's hidden state -> the log of the score
KVzip's reconstruction pass would give it, one output per KV head.

`kvwise calibrate` trains one per model (`adaptive.surrogate_training`) and stores it beside the
model's profile, named by the weights' fingerprint; the one for the embedded model ships with the
package. The file is safetensors: per layer, input standardization and one or two dense layers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvwise.core.calibrated import calibrated_path, find_calibrated

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
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {
            f"layer{index}.{name}": tensor.contiguous().float()
            for index, weights in self.layers.items()
            for name, tensor in weights.items()
        }
        metadata = {"fingerprint": self.fingerprint, "info": json.dumps(self.info)}
        save_file(tensors, str(path), metadata=metadata)
        return path

    @classmethod
    def load(cls, path: str | Path) -> ScoreSurrogate:
        from safetensors import safe_open

        layers: dict[int, dict[str, torch.Tensor]] = {}
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
                for key in handle.keys():
                    layer, _, name = key.partition(".")
                    layers.setdefault(int(layer.removeprefix("layer")), {})[name] = handle.get_tensor(key)
        except Exception as error:  # a truncated or foreign file: name it, never guess
            raise ValueError(f"{path} is not a kvzap surrogate: {error}") from None
        if "fingerprint" not in metadata:
            raise ValueError(f"{path} is not a kvzap surrogate: no fingerprint in its metadata")
        return cls(metadata["fingerprint"], layers, json.loads(metadata.get("info", "{}")))


def user_surrogate_path(fingerprint: str) -> Path:
    """Where `kvwise calibrate` writes a model's surrogate (beside its profile)."""
    return calibrated_path(fingerprint, SUFFIX)


def find_surrogate(fingerprint: str, path: str | Path | None = None) -> ScoreSurrogate | None:
    """`path` if given, else the user's (from `kvwise calibrate`), else the shipped one; None if none."""
    return find_calibrated(fingerprint, SUFFIX, ScoreSurrogate.load, "the kvzap surrogate {path} was trained", path)
