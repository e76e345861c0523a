"""The model's RMSNorms, gated SiLU MLPs and rotary embeddings through the CPU kernels'
one-pass `rms_norm`, `silu_mul` and `rotary`, while the runner's forward runs.

transformers writes RMSNorm as five tensor operations, the MLP's activation as two and rotary
embedding as six, each a pass over memory and a dispatch; profiled on a float32 batch of the
embedded model, they took about half the time of its linear layers. vLLM's CPU backend fuses the
same steps.

Which modules take the kernels is decided by what they compute, not by their class: at
construction each candidate (a module with one weight row and an epsilon; a module with
`gate_proj`, `up_proj`, `down_proj` and `act_fn`; the `apply_rotary_pos_emb` of an attention
module's modeling file) runs on probes (rows with their own offsets, at two scales), and only
one whose output the kernel reproduces within a few units in the dtype's last place is swapped.
Gemma's `1 + weight` norm, a norm that subtracts the mean, a GELU or clamped MLP fail the probe
and keep transformers' code. A rotary call that is not the plain form (cos for part of each head,
one cos row for a batch, extra arguments) goes to transformers' function at run time. Afterwards
the model is exactly as it was, so other users of the same model object see transformers' code.

The rotary function is a global of its modeling file, so while any runner's forward runs, other
models of that family in the process take the kernel too; it computes what the probe showed the
original computes. Swaps are counted (`AttributeSwaps`): the original is back once the last
forward that swapped it ends, and one that something else replaced meanwhile is left alone.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch

from kvwise.engine.attribute_swaps import ABSENT, swaps

DTYPES = (torch.float32, torch.bfloat16)
PROBE_ROWS = 3
# probes at two scales: the second drives projections past the limits of clamped SwiGLUs
PROBE_SCALES = (1.0, 100.0)
# how far the kernel may differ from transformers on a probe, against the probe's largest output:
# the order of a sum, a few units in the last place of the dtype
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-6}
ROTARY_NAME = "apply_rotary_pos_emb"


class FusedLayers:
    def __init__(self, model: torch.nn.Module, rms_norm, silu_mul, rotary):
        """rms_norm, silu_mul, rotary: the kernels (`cpu_kernel.elementwise_kernels()`)."""
        self.rms_norm, self.silu_mul, self.rotary = rms_norm, silu_mul, rotary
        self.norms = [module for module in model.modules() if self._is_rms_norm(module)]
        self.mlps = [module for module in model.modules() if self._is_gated_silu(module)]
        self.forwards = [functools.partial(self._norm_forward, module) for module in self.norms] + [
            functools.partial(self._mlp_forward, module) for module in self.mlps
        ]
        # modeling module -> the `apply_rotary_pos_emb` the probe checked (only that one is swapped)
        self.rotary_files = self._rotary_files(model)

    def __bool__(self) -> bool:
        return bool(self.norms or self.mlps or self.rotary_files)

    @contextlib.contextmanager
    def active(self):
        swapped = []
        try:
            for module, forward in zip([*self.norms, *self.mlps], self.forwards):
                if swaps.enter(module, "forward", forward, ABSENT):
                    swapped.append((module, "forward"))
            for modeling, probed in self.rotary_files.items():
                if swaps.enter(modeling, ROTARY_NAME, self._rotary_function(probed), probed):
                    swapped.append((modeling, ROTARY_NAME))
            yield
        finally:
            for target, name in swapped:
                swaps.leave(target, name)

    # ---- RMSNorm ---------------------------------------------------------------------------------
    def _is_rms_norm(self, module: torch.nn.Module) -> bool:
        weight = getattr(module, "weight", None)
        if not _plain_cpu_module(module) or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            return False
        if _epsilon(module) is None or len(list(module.parameters())) != 1 or weight.dtype not in DTYPES:
            return False
        return all(
            _agrees(module, functools.partial(self._normalize, module), probe)
            for probe in _probes((PROBE_ROWS, weight.shape[0]), weight.dtype)
        )

    def _normalize(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.rms_norm(x, module.weight, _epsilon(module))

    def _norm_forward(self, module: torch.nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or not _kernel_input(x, module.weight.dtype):
            return type(module).forward(module, x, *args, **kwargs)
        return self._normalize(module, x)

    # ---- gated SiLU MLP --------------------------------------------------------------------------
    def _is_gated_silu(self, module: torch.nn.Module) -> bool:
        parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        if not _plain_cpu_module(module) or not all(isinstance(part, torch.nn.Linear) for part in parts):
            return False
        if not hasattr(module, "act_fn") or parts[0].weight.dtype not in DTYPES:
            return False
        return all(
            _agrees(module, functools.partial(self._gated, module), probe)
            for probe in _probes((PROBE_ROWS, parts[0].in_features), parts[0].weight.dtype)
        )

    def _gated(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module.down_proj(self.silu_mul(module.gate_proj(x), module.up_proj(x)))

    def _mlp_forward(self, module: torch.nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or not _kernel_input(x, module.gate_proj.weight.dtype):
            return type(module).forward(module, x, *args, **kwargs)
        return self._gated(module, x)

    # ---- rotary embedding -------------------------------------------------------------------------
    def _rotary_files(self, model: torch.nn.Module) -> dict:
        """{modeling module: its `apply_rotary_pos_emb`} for the files whose function the kernel
        reproduces on a probe of the model's head width and dtype."""
        files = {}
        for module in model.modules():
            projection = getattr(module, "q_proj", None)
            head_dim = getattr(module, "head_dim", None)
            modeling = sys.modules.get(type(module).__module__)
            if not isinstance(projection, torch.nn.Linear) or not isinstance(head_dim, int) or modeling is None:
                continue
            if projection.weight.device.type == "cpu" and projection.weight.dtype in DTYPES:
                files.setdefault(modeling, (head_dim, projection.weight.dtype))
        probed = {modeling: getattr(modeling, ROTARY_NAME, None) for modeling in files}
        return {
            modeling: function
            for modeling, function in probed.items()
            if callable(function)
            and not getattr(function, "kvwise_fused", False)
            and self._rotates_as(function, *files[modeling])
        }

    def _rotates_as(self, original, head_dim: int, dtype: torch.dtype) -> bool:
        if head_dim % 2:
            return False
        query, key = _probe((1, 4, 5, head_dim), dtype), _probe((1, 2, 5, head_dim), dtype).flip(-1)
        angles = _probe((1, 5, head_dim), dtype, scale=10.0)
        cos, sin = angles.cos(), angles.sin()
        fused = self._rotary_function(original)

        def both(function) -> torch.Tensor:
            return torch.cat([part.flatten() for part in function(query, key, cos, sin)])

        return _agrees(lambda: both(original), lambda: both(fused))

    def _rotary_function(self, original):
        """The kernel where the call is the plain form: queries and keys [batch, heads, tokens,
        dim] and cos, sin [batch, tokens, dim] of the same batch, tokens and width. Anything else
        (cos for part of the head, one cos row for a batch, extra arguments) goes to `original`."""

        def apply_rotary_pos_emb(q, k, cos, sin, *args, unsqueeze_dim=1, **kwargs):
            if args or kwargs or unsqueeze_dim != 1 or not self._plain_rotary(q, k, cos, sin):
                return original(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
            return self.rotary(q, cos, sin), self.rotary(k, cos, sin)

        apply_rotary_pos_emb.kvwise_fused = True
        return apply_rotary_pos_emb

    @staticmethod
    def _plain_rotary(q, k, cos, sin) -> bool:
        if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
            return False
        batch, _, tokens, dim = q.shape
        if cos.shape != (batch, tokens, dim) or (k.shape[0], k.shape[2], k.shape[3]) != (batch, tokens, dim):
            return False
        return (
            all(_rows_input(x, q.dtype) for x in (q, k)) and _kernel_input(cos, q.dtype) and _kernel_input(sin, q.dtype)
        )


def _rows_input(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """[batch, heads, tokens, dim] with each row contiguous (a transposed projection is)."""
    return (
        x.device.type == "cpu"
        and x.dtype == dtype
        and x.stride(-1) == 1
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def _plain_cpu_module(module: torch.nn.Module) -> bool:
    """Not already wrapped on the instance (accelerate's offloading hooks), and on CPU."""
    parameter = next(module.parameters(), None)
    return "forward" not in vars(module) and parameter is not None and parameter.device.type == "cpu"


def _epsilon(module: torch.nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float | int) and not isinstance(value, bool):
            return float(value)
    return None


def _kernel_input(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """The kernels take contiguous CPU tensors of the weights' dtype, and keep no autograd graph."""
    return (
        x.device.type == "cpu"
        and x.dtype == dtype
        and x.is_contiguous()
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def _probe(shape: tuple, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


def _probes(shape: tuple[int, int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Rows with their own offsets (a norm that subtracts the mean differs on them), at each of
    PROBE_SCALES."""
    offsets = torch.tensor([0.0, 3.0, -2.0]).repeat(-(-shape[0] // 3))[: shape[0], None]
    base = _probe(shape, torch.float32) + offsets
    return [(base * scale).to(dtype) for scale in PROBE_SCALES]


def _agrees(reference, candidate, *inputs) -> bool:
    """Whether candidate(*inputs) computes what reference(*inputs), the module's own code, does:
    within a few units in the dtype's last place of the largest output."""
    try:
        with torch.no_grad():
            expected, got = reference(*inputs), candidate(*inputs)
    except Exception:  # a module that cannot run the probe keeps its own code
        return False
    if not isinstance(expected, torch.Tensor) or expected.shape != got.shape or expected.dtype != got.dtype:
        return False
    if not torch.isfinite(expected).all():
        return False
    largest = expected.float().abs().max().item()
    return bool((got.float() - expected.float()).abs().max().item() <= TOLERANCE[got.dtype] * max(largest, 1e-30))
