"""A kvzap surrogate for tiny random models: fixed random linear heads, one per full-attention layer."""

from __future__ import annotations

import pytest
import torch

from kvwise.hf.geometry import kv_geometry
from kvwise.policies.kvzap import KVzapPolicy
from kvwise.policies.score_surrogate import ScoreSurrogate
from kvwise.util.fingerprint import weights_fingerprint


def random_surrogate(model, seed: int = 0) -> ScoreSurrogate:
    config = model.config.get_text_config(decoder=True)
    geometry = kv_geometry(model)
    generator = torch.Generator().manual_seed(seed)
    hidden, heads = config.hidden_size, geometry.num_kv_heads
    layers = {
        index: {
            "mean": torch.zeros(hidden),
            "scale": torch.ones(hidden),
            "w1": torch.randn(hidden, heads, generator=generator) / hidden**0.5,
            "b1": torch.full((heads,), -3.0),
        }
        for index, window in enumerate(geometry.windows)
        if window is None
    }
    return ScoreSurrogate(weights_fingerprint(model), layers, {"data": "random, for tests"})


@pytest.fixture
def kvzap_surrogate(monkeypatch):
    """kvzap on any model the test builds: its trained surrogate if there is one, else a random one."""
    attach = KVzapPolicy.attach

    def attach_or_random(self, model):
        try:
            attach(self, model)
        except ValueError:
            self.surrogate = random_surrogate(model)

    monkeypatch.setattr(KVzapPolicy, "attach", attach_or_random)
