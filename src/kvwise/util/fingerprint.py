"""A fingerprint of a model's weights: what names its KV on every tier, instead of its path.

KV computed by one set of weights is wrong for another. A path says nothing when a checkpoint is
replaced in place, and two copies of one checkpoint under different paths should share. So the
fingerprint hashes the architecture, every parameter's name and shape, and a strided sample of
its values rounded to bfloat16, on the CPU: the same weights loaded in float32 or bfloat16, on
CPU or CUDA, give the same fingerprint, while any retrained or swapped tensor changes it. The cost
is bounded: 64 values per parameter, whatever the model's size.
"""

from __future__ import annotations

import hashlib
import weakref

import torch

SAMPLES_PER_TENSOR = 64
# model -> its fingerprint; weak, so a model's entry goes with the model
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.no_grad()
def weights_fingerprint(model) -> str:
    """32 hex digits, computed once per model object."""
    cached = _FINGERPRINTS.get(model)
    if cached is not None:
        return cached
    digest = hashlib.blake2b(digest_size=16, person=b"kvwise-weights")
    digest.update(type(model).__name__.encode())
    for name, parameter in model.named_parameters():
        flat = parameter.detach().reshape(-1)
        step = max(1, flat.numel() // SAMPLES_PER_TENSOR)
        sample = flat[::step][:SAMPLES_PER_TENSOR].to("cpu", torch.bfloat16).to(torch.float32)
        digest.update(f"{name}:{tuple(parameter.shape)}".encode())
        digest.update(sample.numpy().tobytes())
    fingerprint = digest.hexdigest()
    _FINGERPRINTS[model] = fingerprint
    return fingerprint


def forget_weights_fingerprint(model) -> None:
    """Drop `model`'s remembered fingerprint: call it after changing its weights in place, so the
    next `weights_fingerprint` (and every namespace built on it) sees the new weights."""
    _FINGERPRINTS.pop(model, None)
