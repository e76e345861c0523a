"""Start `kvwise serve` as a real process on a free 127.0.0.1 port, and read its /metrics."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LiveServer:
    def __init__(
        self,
        *options: str,
        startup_seconds: float = 120.0,
        metrics_key: str | None = None,
        python: str = sys.executable,  # another environment's interpreter, to serve from it
        port: int | None = None,  # default: a free one
    ):
        self.metrics_key = metrics_key  # an admin key, sent when reading /metrics
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        command = [python, "-m", "kvwise.cli", "serve", "--port", str(self.port), "--log-level", "warning"]
        self.process = subprocess.Popen(
            [*command, *options], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        deadline = time.monotonic() + startup_seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvwise serve exited with {self.process.returncode}:\n{self.process.stdout.read()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"kvwise serve did not answer /health within {startup_seconds} s")

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """{(sample name, sorted label items): value} from /metrics."""
        headers = {"Authorization": f"Bearer {self.metrics_key}"} if self.metrics_key else {}
        answer = httpx.get(f"{self.base_url}/metrics", headers=headers, timeout=10)
        answer.raise_for_status()
        text = answer.text
        samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
        assert all("model_name" in sample.labels for sample in samples), "a series without model_name"
        return {  # looked up without the model_name every series carries
            (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))): sample.value
            for sample in samples
        }

    def value(self, name: str, **labels) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode
