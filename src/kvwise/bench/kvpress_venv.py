"""The private virtualenv of NVIDIA kvpress, the peer of `kvwise bench niah --compare kvpress`.

kvpress 0.5.x requires transformers<5.3, older than the transformers kvwise runs with, so it
lives in `$KVWISE_HOME/kvpress-venv` (`peer_venv.PeerVenv`).
"""

from __future__ import annotations

from pathlib import Path

from kvwise.bench.peer_venv import MARKER_NAME, PeerUnavailable, PeerVenv

__all__ = ["KVPRESS", "MARKER_NAME", "KvpressUnavailable", "kvpress_python", "kvpress_venv_dir"]


class KvpressUnavailable(PeerUnavailable):
    """kvpress could not be installed or run; the message is one line saying what failed."""


KVPRESS = PeerVenv("kvpress", "kvpress>=0.5,<0.6", "KVWISE_KVPRESS_PIP_ARGS", KvpressUnavailable)


def kvpress_venv_dir() -> Path:
    return KVPRESS.directory()


def kvpress_python() -> Path:
    """The kvpress virtualenv's python, creating the virtualenv first if it is missing or incomplete."""
    return KVPRESS.python()
