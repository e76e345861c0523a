"""Where kvwise keeps what it makes: converted models, built kernels, secrets (`$KVWISE_HOME`)."""

from __future__ import annotations

import os
from pathlib import Path


def kvwise_home() -> Path:
    """`$KVWISE_HOME`, default `~/.cache/kvwise`."""
    return Path(os.environ.get("KVWISE_HOME", Path.home() / ".cache" / "kvwise"))
