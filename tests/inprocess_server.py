"""`kvwise serve`'s app on a real uvicorn server in a thread of the test process, on loopback, so a
test can reach the engine (its step log, its pools) while clients talk HTTP to it."""

from __future__ import annotations

from kvwise.bench.loopback_server import LoopbackServer as InProcessServer

__all__ = ["InProcessServer"]
