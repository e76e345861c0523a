"""The model's RMSNorms, gated SiLU MLPs and rotary embeddings through the CPU kernels'
one-pass `rms_norm`, `silu_mul` and `rotary`, while the runner's forward runs.

transformers writes RMSNorm as five tensor operations, the MLP's activation as two and rotary
embedding as six, each a pass over memory and a dispatch; profiled on a float32 batch of the
embedded model, they took about half the time of its linear layers. vLLM's CPU backend fuses the
same steps.

Which modules take the kernels is decided by what they compute, not by their class: at
construction each candidate (a module with one weight row and an epsilon; a module with
`gate_proj`, `up_proj`, `down_proj` and `act_fn`; the `apply_rotary_pos_emb` of an attention
module's modeling file) runs on a probe, and only one whose output the kernel reproduces (within
the dtype's last bits) is swapped. Gemma's `1 + weight` norm, a GELU MLP, a norm with a bias or a
partial rotary embedding fail the probe and keep transformers' code. Afterwards the model is
exactly as it was, so other users of the same model object see transformers' forwards.

The rotary function is a global of its modeling file, so while any runner's forward runs, other
models of that family in the process take the kernel too; it computes what the probe showed the
original computes, and the original is back once the last such forward ends.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading

import torch

DTYPES = (torch.float32, torch.bfloat16)
PROBE_ROWS = 3
# how far the kernel may differ from transformers on the probe: the order of a sum, a unit or two
# in the last place of the dtype, never a missing term or rounding step
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-6, 2**-6)}
ROTARY_NAME = "apply_rotary_pos_emb"
# modeling module -> [forwards running with the kernel in place, transformers' function]
_rotary_swaps: dict = {}
_rotary_lock = threading.Lock()


class FusedLayers:
    def __init__(self, model: torch.nn.Module, rms_norm, silu_mul, rotary):
        """rms_norm, silu_mul, rotary: the kernels (`cpu_kernel.elementwise_kernels()`)."""
        self.rms_norm, self.silu_mul, self.rotary = rms_norm, silu_mul, rotary
        self.norms = [module for module in model.modules() if self._is_rms_norm(module)]
        self.mlps = [module for module in model.modules() if self._is_gated_silu(module)]
        self.forwards = [functools.partial(self._norm_forward, module) for module in self.norms] + [
            functools.partial(self._mlp_forward, module) for module in self.mlps
        ]
        self.rotary_files = self._rotary_files(model)

    def __bool__(self) -> bool:
        return bool(self.norms or self.mlps or self.rotary_files)

    @contextlib.contextmanager
    def active(self):
        modules = [*self.norms, *self.mlps]
        for module, forward in zip(modules, self.forwards):
            module.forward = forward
        self._swap_rotary(+1)
        try:
            yield
        finally:
            self._swap_rotary(-1)
            for module in modules:
                del module.forward

    # ---- RMSNorm ---------------------------------------------------------------------------------
    def _is_rms_norm(self, module: torch.nn.Module) -> bool:
        weight = getattr(module, "weight", None)
        if not _plain_cpu_module(module) or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            return False
        if _epsilon(module) is None or len(list(module.parameters())) != 1 or weight.dtype not in DTYPES:
            return False
        probe = _probe((PROBE_ROWS, weight.shape[0]), weight.dtype)
        return _agrees(lambda: module(probe), lambda: self._normalize(module, probe))

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
        probe = _probe((PROBE_ROWS, parts[0].in_features), parts[0].weight.dtype)
        return _agrees(lambda: module(probe), lambda: self._gated(module, probe))

    def _gated(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module.down_proj(self.silu_mul(module.gate_proj(x), module.up_proj(x)))

    def _mlp_forward(self, module: torch.nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or not _kernel_input(x, module.gate_proj.weight.dtype):
            return type(module).forward(module, x, *args, **kwargs)
        return self._gated(module, x)

    # ---- rotary embedding -------------------------------------------------------------------------
    def _rotary_files(self, model: torch.nn.Module) -> list:
        """The modeling modules whose `apply_rotary_pos_emb` the kernel reproduces on a probe of
        the model's head width and dtype."""
        files = {}
        for module in model.modules():
            projection = getattr(module, "q_proj", None)
            head_dim = getattr(module, "head_dim", None)
            modeling = sys.modules.get(type(module).__module__)
            if not isinstance(projection, torch.nn.Linear) or not isinstance(head_dim, int) or modeling is None:
                continue
            if projection.weight.device.type == "cpu" and projection.weight.dtype in DTYPES:
                files.setdefault(modeling, (head_dim, projection.weight.dtype))
        return [modeling for modeling, shape in files.items() if self._rotates_as(modeling, *shape)]

    def _rotates_as(self, modeling, head_dim: int, dtype: torch.dtype) -> bool:
        with _rotary_lock:
            original = _rotary_swaps[modeling][1] if modeling in _rotary_swaps else getattr(modeling, ROTARY_NAME, None)
        if not callable(original) or head_dim % 2:
            return False
        query, key = _probe((1, 4, 5, head_dim), dtype), _probe((1, 2, 5, head_dim), dtype).flip(-1)
        cos, sin = _probe((1, 5, head_dim), dtype).cos(), _probe((1, 5, head_dim), dtype).sin()
        fused = self._rotary_function(original)

        def both(function) -> torch.Tensor:
            return torch.cat([part.flatten() for part in function(query, key, cos, sin)])

        return _agrees(lambda: both(original), lambda: both(fused))

    def _rotary_function(self, original):
        def apply_rotary_pos_emb(q, k, cos, sin, *args, unsqueeze_dim=1, **kwargs):
            usable = (
                not args
                and not kwargs
                and unsqueeze_dim == 1
                and q.dim() == 4
                and cos.dim() == 3
                and _kernel_input(cos, q.dtype)
                and _kernel_input(sin, q.dtype)
                and all(_rows_input(x, q.dtype) for x in (q, k))
            )
            if not usable:
                return original(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
            return self.rotary(q, cos, sin), self.rotary(k, cos, sin)

        apply_rotary_pos_emb.kvwise_fused = True
        return apply_rotary_pos_emb

    def _swap_rotary(self, step: int) -> None:
        """Put the kernel in each of this model's modeling files (step +1), or count one forward
        out and put transformers' function back after the last (step -1)."""
        with _rotary_lock:
            for modeling in self.rotary_files:
                if step > 0:
                    swap = _rotary_swaps.setdefault(modeling, [0, getattr(modeling, ROTARY_NAME)])
                    if swap[0] == 0:
                        setattr(modeling, ROTARY_NAME, self._rotary_function(swap[1]))
                    swap[0] += 1
                    continue
                swap = _rotary_swaps[modeling]
                swap[0] -= 1
                if swap[0] == 0:
                    setattr(modeling, ROTARY_NAME, swap[1])
                    del _rotary_swaps[modeling]


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


def _probe(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=generator).to(dtype)


def _agrees(reference, candidate) -> bool:
    """Whether the candidate computes what the module's own forward does, on the probe."""
    try:
        with torch.no_grad():
            expected, got = reference(), candidate()
    except (RuntimeError, TypeError, ValueError, AttributeError):
        return False
    if not isinstance(expected, torch.Tensor) or expected.shape != got.shape or expected.dtype != got.dtype:
        return False
    rtol, atol = TOLERANCE[got.dtype]
    return bool(torch.allclose(expected.float(), got.float(), rtol=rtol, atol=atol))
