"""The CPU decode-attention kernel (kernels/paged_decode.cpp), compiled once per machine.

The build lands in `$KVWISE_HOME/kernels/<hash>`: the hash covers the source, the compiler flags
and the CPU's instruction sets, because `-march=native` code must not run on another CPU.
Without a compiler (or with KVWISE_CPU_KERNEL=0) the runner falls back to SDPA, with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import warnings
from pathlib import Path

from kvwise.models import kvwise_home

SOURCE = Path(__file__).parent / "kernels" / "paged_decode.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp"]  # -fopenmp: at::parallel_for is serial without it


@functools.cache
def paged_decode_kernel():
    """`paged_decode(query, keys, values, tables, lengths, scale, softcap, window)`, or None."""
    if os.environ.get("KVWISE_CPU_KERNEL", "1") == "0":
        return None
    try:
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_signature()).hexdigest()[:16]
        build = kvwise_home() / "kernels" / digest
        build.mkdir(parents=True, exist_ok=True)
        name = f"kvwise_paged_decode_{digest}"
        if not (build / f"{name}.so").exists():
            print("kvwise: compiling the CPU decode-attention kernel (once per machine, ~30 s)", file=sys.stderr)
        module = cpp_extension.load(
            name, [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(build)
        )
        return module.paged_decode
    except Exception as error:  # no compiler, no headers, no ninja: SDPA still works
        warnings.warn(f"kvwise: the CPU decode kernel could not be built, using SDPA instead ({error})", stacklevel=2)
        return None


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the pip package's binary is not there unless the
    virtual environment is activated."""
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _cpu_signature() -> bytes:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor().encode()
    return next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), "").encode()
