"""kvwise's CPU kernels (kernels/*.cpp), compiled once per machine into one module: decode
attention over the paged pool (paged_decode.cpp), projections of a few rows (small_linear.cpp, and
small_linear_bf16.cpp where the CPU has AVX512-BF16), prefill attention with AVX-512
(prefill_attention.cpp), RMSNorm, SiLU(gate) * up and rotary embedding in one pass each (elementwise.cpp) and tier
entries copied into pool blocks (block_copy.cpp).

The build lands in `$KVWISE_HOME/kernels/<hash>`. The hash covers everything the binary depends
on: the sources, the flags, the CPU's instruction sets (`-march=native` code must not run on
another CPU), torch's version and C++ ABI, the Python ABI and the compiler. Only x86 CPUs with
AVX2 and FMA use it (elsewhere its inner loops would be scalar and lose to SDPA and BLAS).
Without a compiler, or with KVWISE_CPU_KERNEL=0, the runner uses SDPA and torch's linear; a
failed build is remembered (`FAILED` in the build directory, with the compiler's message) so
later processes do not retry.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import sys
import sysconfig
import warnings
from pathlib import Path

import torch

from kvwise.kv.paged import register_entry_writer
from kvwise.util.home import kvwise_home

SOURCES = sorted((Path(__file__).parent / "kernels").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "kernels").glob("*.h"))  # included by the sources
FLAGS = ["-O3", "-march=native", "-fopenmp"]  # -fopenmp: at::parallel_for is serial without it


def paged_decode_kernel():
    """`paged_decode(query, keys, values, tables, lengths, scale, softcap, window)`, or None."""
    return getattr(cpu_kernels(), "paged_decode", None)


def rows_decode_kernel():
    """`paged_decode_rows(query, keys, values, rows, lengths, scale, softcap)`, or None."""
    return getattr(cpu_kernels(), "paged_decode_rows", None)


def quantized_decode_kernel():
    """`quantized_decode(query, keys, values, tables, lengths, scale, softcap, window, *key_role,
    *value_role)` (engine/quantized_kernel.py builds the roles), or None."""
    return getattr(cpu_kernels(), "quantized_decode", None)


def block_write_kernel():
    """`write_blocks(pool [2, layers, blocks, ...], block_ids [n] int64, entries [n] of [layers, 2, ...])`,
    or None."""
    return getattr(cpu_kernels(), "write_blocks", None)


def write_entries_in_kernel(pool, block_ids, entries) -> bool:
    """`PagedKVStorage.write_entries` through `write_blocks`; False where the kernels are not built."""
    kernel = block_write_kernel()
    if kernel is None:
        return False
    kernel(pool, block_ids, entries)
    return True


def small_linear_bf16_kernel():
    """`small_linear_bf16(x [M, K], weight [N, K], bias [N] | None) -> [M, N]` in bfloat16, or None
    where the kernels are not built or this CPU has no AVX512-BF16."""
    kernels = cpu_kernels()
    available = getattr(kernels, "small_linear_bf16_available", None)
    return kernels.small_linear_bf16 if available is not None and available() else None


def elementwise_kernels():
    """(`rms_norm(x, weight, eps)`, `silu_mul(gate, up)`, `rotary(x, cos, sin)`) in float32 and
    bfloat16, or None where the kernels are not built or this build has no AVX-512."""
    kernels = cpu_kernels()
    available = getattr(kernels, "elementwise_available", None)
    if available is None or not available():
        return None
    return kernels.rms_norm, kernels.silu_mul, kernels.rotary


def prefill_attention_kernel(dtype: torch.dtype):
    """`prefill_attention(query [T, H, D], keys, values [blocks, block_size, KVH, D], table [blocks]
    int64, start, scale) -> [T, H, D]`: causal attention of a chunk at positions start .. start+T-1
    in `dtype` (float32 or bfloat16), or None where the kernels are not built or this CPU lacks the
    dtype's instructions (float32: AVX-512; bfloat16: AVX512-BF16)."""
    kernels = cpu_kernels()
    available = getattr(kernels, "prefill_attention_available", None)
    if dtype not in (torch.float32, torch.bfloat16) or available is None:
        return None
    return kernels.prefill_attention if available(dtype == torch.bfloat16) else None


def small_linear_kernel():
    """`small_linear(x [M, K], weight [N, K], bias [N] | None) -> [M, N]`, or None."""
    return getattr(cpu_kernels(), "small_linear", None)


@functools.cache
def cpu_kernels():
    """The compiled module, or None where it cannot or should not be built."""
    if os.environ.get("KVWISE_CPU_KERNEL", "1") == "0" or not _has_vector_units():
        return None
    build = kvwise_home() / "kernels" / _digest(FLAGS)
    failed = build / "FAILED"
    if failed.exists():
        warnings.warn(
            f"kvwise: using SDPA (decode several times slower); the CPU kernels failed to build before (see {failed})",
            stacklevel=2,
        )
        return None
    try:
        return build_kernel(FLAGS, build)
    except Exception as error:  # no compiler, no headers, no ninja: SDPA still works
        with contextlib.suppress(OSError):  # an unwritable $KVWISE_HOME: just retry next time
            failed.write_text(f"{error}\n\nDelete this file to try again.\n")
        warnings.warn(
            f"kvwise: the CPU kernels could not be built (a C++ compiler and ninja are needed: "
            f"pip install 'kvwise[server]'); using SDPA, decode several times slower ({failed})",
            stacklevel=2,
        )
        return None


def build_kernel(flags: list[str], build: Path | None = None):
    """Compile (or load the compiled) kernels' module with `flags` (tests build AVX2-only and
    portable variants); raises if the compiler fails."""
    build = build or kvwise_home() / "kernels" / _digest(flags)
    build.mkdir(parents=True, exist_ok=True)
    with _exclusive(build / "kvwise.lock"):
        return _load(build, flags)


def _load(build: Path, flags: list[str]):
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    # torch's own lock file outlives a process killed mid-build and would make every later
    # build wait for ever; under our flock (released by the OS when its holder dies) no one
    # else is building here, so a leftover one is stale
    (build / "lock").unlink(missing_ok=True)
    name = f"kvwise_cpu_kernels_{build.name}"
    if not (build / f"{name}.so").exists():
        print("kvwise: compiling the CPU kernels (once per machine, ~60 s)", file=sys.stderr)
    return cpp_extension.load(
        name,
        [str(source) for source in _sources_in(build)],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
    )


def _sources_in(build: Path) -> list[Path]:
    """Copies of the sources inside the build directory. Its name hashes their contents, so every
    install of the same kernels on this machine (another venv, a git worktree) compiles the same
    paths; from their own paths, each would make ninja rebuild what the other built. A copy is
    rewritten only when its bytes differ, so an unchanged one keeps its time and is not rebuilt."""
    folder = build / "sources"
    folder.mkdir(exist_ok=True)
    copies = []
    for source in (*SOURCES, *HEADERS):
        copy, data = folder / source.name, source.read_bytes()
        if not copy.exists() or copy.read_bytes() != data:
            copy.write_bytes(data)
        if source.suffix == ".cpp":
            copies.append(copy)
    return copies


@contextlib.contextmanager
def _exclusive(path: Path):
    """An flock on `path`: one process builds or loads the kernel at a time."""
    import fcntl  # POSIX; elsewhere _has_vector_units() already said no

    with open(path, "a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def _digest(flags: list[str]) -> str:
    import torch

    parts = [
        *(source.read_bytes() for source in (*SOURCES, *HEADERS)),
        " ".join(flags).encode(),
        _cpu_flags().encode(),
        torch.__version__.encode(),
        str(torch.compiled_with_cxx11_abi()).encode(),
        str(sysconfig.get_config_var("SOABI")).encode(),
        os.environ.get("CXX", "c++").encode(),
    ]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in info.splitlines() if line.startswith("flags")), "")


def _has_vector_units() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    flags = set(_cpu_flags().split())
    return {"avx2", "fma"} <= flags


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the pip package's binary is not there unless the
    virtual environment is activated."""
    try:
        import ninja
    except ImportError:
        return
    directory = getattr(ninja, "BIN_DIR", "")
    if directory and directory not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = directory + os.pathsep + os.environ.get("PATH", "")


def kernel_status(retry: bool = False) -> str:
    """One line on what decode runs on this machine: the kernels (built now if they were not), or
    why SDPA (for `kvwise build-kernels` and the server's startup). retry: forget an earlier
    failed build and try again (after installing a compiler or ninja)."""
    if retry:
        (kvwise_home() / "kernels" / _digest(FLAGS) / "FAILED").unlink(missing_ok=True)
        cpu_kernels.cache_clear()
    if os.environ.get("KVWISE_CPU_KERNEL", "1") == "0":
        return "CPU kernels off (KVWISE_CPU_KERNEL=0): decode uses SDPA"
    if not _has_vector_units():
        return "this CPU has no AVX2/FMA: decode uses SDPA and torch's linear"
    module = cpu_kernels()
    if module is None:
        return (
            f"CPU kernels unavailable (see {kvwise_home() / 'kernels' / _digest(FLAGS) / 'FAILED'}): decode uses SDPA"
        )
    return f"CPU kernels ready: {Path(module.__file__).parent}"


# the storage sits a floor below and cannot import the kernels: it is handed the copy instead
register_entry_writer(write_entries_in_kernel)
