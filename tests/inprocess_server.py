"""`kvwise serve`'s app on a real uvicorn server in a thread of the test process, on loopback, so a
test can reach the engine (its step log, its pools) while clients talk HTTP to it."""

from __future__ import annotations

import threading
import time

import httpx
import uvicorn

from tests.live_server import free_port


class InProcessServer:
    def __init__(self, app, startup_seconds: float = 60.0, **uvicorn_options):
        self.app, self.port = app, free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", **uvicorn_options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + startup_seconds
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("the in-process server did not answer /health")

    @property
    def engine(self):
        return self.app.state.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
