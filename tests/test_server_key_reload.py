"""`kvwise serve --api-keys`: SIGHUP reloads the key file without a restart; a broken file keeps
the old keys."""

from __future__ import annotations

import signal
import time

import httpx

from tests.base_model import save_base_model
from tests.live_server import LiveServer


def status(server, key: str) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.get(f"{server.base_url}/v1/models", headers=headers, timeout=10).status_code


def wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_sighup_reloads_the_key_file(tmp_path):
    model = save_base_model(tmp_path / "model", max_positions=64)
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-old alice\n")
    server = LiveServer("--model", str(model), "--device", "cpu", "--api-keys", str(keys))
    try:
        assert status(server, "sk-old") == 200 and status(server, "sk-new") == 401
        keys.write_text("sk-new bob\n")  # alice's key revoked, bob's added
        server.process.send_signal(signal.SIGHUP)
        assert wait_for(lambda: status(server, "sk-new") == 200)
        assert status(server, "sk-old") == 401
        keys.write_text("this line is not a key entry at all\n")
        server.process.send_signal(signal.SIGHUP)
        time.sleep(1)
        assert status(server, "sk-new") == 200  # the broken file was refused; the keys stay
    finally:
        assert server.stop() == 0
