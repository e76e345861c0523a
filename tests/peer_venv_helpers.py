"""Point a peer's private virtualenv (`kvwise.bench.peer_venv`) at an index nothing listens on."""

from __future__ import annotations

import os


def without_an_index(monkeypatch, tmp_path, peer):
    """pip sees only an index nothing listens on: the machine's own pip configuration (local
    wheel folders, extra indexes) is set aside, so `peer`'s install fails as it would offline.
    Returns where its virtualenv goes."""
    monkeypatch.setenv("KVWISE_HOME", str(tmp_path))
    monkeypatch.setenv(peer.pip_args_env, "--index-url http://127.0.0.1:9/simple --retries 0 --timeout 1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(name, raising=False)
    return peer.directory()
