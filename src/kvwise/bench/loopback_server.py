"""`kvwise serve`'s app on a real uvicorn server in a thread, on a free loopback port: benches
that measure what a client sees (timing probes, load) talk real HTTP to it."""

from __future__ import annotations

import socket
import threading
import time


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LoopbackServer:
    def __init__(self, app, startup_seconds: float = 60.0, **uvicorn_options):
        import httpx
        import uvicorn

        self.app, self.port = app, free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", **uvicorn_options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="kvwise-loopback", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + startup_seconds
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"the loopback server did not answer /health within {startup_seconds} s")

    @property
    def engine(self):
        return self.app.state.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
