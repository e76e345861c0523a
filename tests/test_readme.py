"""The README's quickstarts run as written: every Python block, and every curl command against a
live `kvwise serve` on the port the README names (8000). The install commands are exercised by
tests/test_packaging.py, and `make run` / `make test` by CI itself."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.live_server import LiveServer
from tests.test_doc_examples import python_blocks

pytestmark = [pytest.mark.smollm, pytest.mark.timeout(900)]

README_PATH = Path(__file__).resolve().parents[1] / "README.md"
README = README_PATH.read_text()
PYTHON_BLOCKS = python_blocks(README_PATH)
CURL_COMMANDS = [
    block for block in re.findall(r"```bash\n(.*?)```", README, flags=re.DOTALL) if block.startswith("curl")
]
NEEDS_SERVER = "127.0.0.1:8000"


@pytest.fixture(scope="module")
def server():
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 8000)) == 0:
            pytest.fail("port 8000 is taken: the README's server examples need it")
    live = LiveServer(port=8000)
    yield live
    assert live.stop() == 0


def test_the_readme_has_its_quickstarts():
    assert len(PYTHON_BLOCKS) >= 3 and CURL_COMMANDS
    assert not re.search(r"\b(issue|session)s?\b|\bcommit [0-9a-f]{7}", README, flags=re.IGNORECASE)


@pytest.mark.parametrize("block", [b for b in PYTHON_BLOCKS if NEEDS_SERVER not in b], ids=lambda b: b.split("\n")[0])
def test_python_blocks_run(block):
    run = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=800)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip()


def test_server_blocks_run(server):
    for command in CURL_COMMANDS:
        run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and '"choices"' in run.stdout, run.stdout + run.stderr
    for block in (b for b in PYTHON_BLOCKS if NEEDS_SERVER in b):
        run = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "prompt tokens came from the prefix cache" in run.stdout
