"""The Python blocks of the docs run as written, each in a fresh interpreter (the embedded model)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.smollm, pytest.mark.timeout(900)]

DOCS = Path(__file__).resolve().parents[1] / "docs"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL)


@pytest.mark.parametrize("block", python_blocks(DOCS / "policies.md"), ids=lambda block: block.splitlines()[0][:40])
def test_policies_blocks_run(block):
    run = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "4821" in run.stdout  # the kvpress switch answers from the compressed context
