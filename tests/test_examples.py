"""Every script under examples/ runs as a user would run it, on the embedded model (small settings
where a script takes them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.live_server import free_port

pytestmark = [pytest.mark.smollm, pytest.mark.timeout(900)]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(script: str, *options: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *options], capture_output=True, text=True, timeout=800
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_every_example_is_smoke_tested():
    tested = {"compress_once_ask_many.py", "from_kvpress.py", "server_with_tenants.py", "bench_your_model.py"}
    assert {path.name for path in EXAMPLES.glob("*.py")} == tested


def test_compress_once_ask_many():
    said = run("compress_once_ask_many.py", "--ratio", "0.5")
    assert said.count("Q: ") == 3 and said.count("reused the compressed document") == 2


def test_from_kvpress():
    said = run("from_kvpress.py")
    assert "blue toolbox" in said.lower() and "156.8" in said


def test_server_with_tenants():
    said = run("server_with_tenants.py", "--port", str(free_port())).splitlines()
    alice_first, alice_again, bob = (int(line.split(", ")[1].split()[0]) for line in said[-3:])
    assert alice_first == 0 and alice_again > 0 and bob == 0


def test_bench_your_model(tmp_path):
    said = run("bench_your_model.py", "--policies", "full", "--out", str(tmp_path))
    assert "full" in said and (tmp_path / "niah" / "niah.json").exists()
