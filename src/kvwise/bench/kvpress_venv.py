"""A private virtualenv for NVIDIA kvpress, the peer of `kvwise bench niah --compare kvpress`.

kvpress 0.5.x requires transformers<5.3, older than the transformers kvwise runs with, so it cannot
be installed next to kvwise. kvwise makes `$KVWISE_HOME/kvpress-venv` on first use, with the same
torch release as its own (a looser pin lets pip fetch a multi-GB CUDA build), and never installs
itself there: the runner that lives in it is a standalone script.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from kvwise.util.home import kvwise_home

log = logging.getLogger("kvwise.bench")

KVPRESS_REQUIREMENT = "kvpress>=0.5,<0.6"
# extra pip arguments (shlex-split), e.g. another index; tests point it at an unreachable one
PIP_ARGS_ENV = "KVWISE_KVPRESS_PIP_ARGS"
VENV_TIMEOUT_S = 300
INSTALL_TIMEOUT_S = 1800
# written only after pip succeeded, so a venv left half-made by a crash or a timeout is rebuilt
MARKER_NAME = "kvwise-installed.json"


class KvpressUnavailable(ValueError):
    """kvpress could not be installed or run; the message is one line saying what failed."""


def kvpress_venv_dir() -> Path:
    return kvwise_home() / "kvpress-venv"


def kvpress_python() -> Path:
    """The kvpress virtualenv's python, creating the virtualenv first if it is missing or incomplete.

    Raises KvpressUnavailable (one line) when the virtualenv or pip fails, or runs past its time.
    """
    venv_dir = kvpress_venv_dir()
    python = _venv_python(venv_dir)
    requirements = _requirements()
    marker = venv_dir / MARKER_NAME
    if python.exists() and _read_marker(marker) == requirements:
        return python
    if venv_dir.exists():
        log.info("kvpress: rebuilding %s (an earlier install did not finish, or torch changed)", venv_dir)
        shutil.rmtree(venv_dir)
    started = time.monotonic()
    log.info("kvpress: creating %s (once; a few minutes): %s", venv_dir, " ".join(requirements))
    venv_dir.parent.mkdir(parents=True, exist_ok=True)
    _run_logged([sys.executable, "-m", "venv", str(venv_dir)], "venv", venv_dir, VENV_TIMEOUT_S)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", *requirements]
    _run_logged(pip + shlex.split(os.environ.get(PIP_ARGS_ENV, "")), "pip", venv_dir, INSTALL_TIMEOUT_S)
    marker.write_text(json.dumps(requirements))
    log.info("kvpress: installed in %s (%.0f s)", venv_dir, time.monotonic() - started)
    return python


def _requirements() -> list[str]:
    """torch pinned to kvwise's own release, less its local suffix (`2.13.0+cpu` -> `torch==2.13.0`)."""
    import torch

    return [f"torch=={torch.__version__.split('+')[0]}", KVPRESS_REQUIREMENT]


def _venv_python(venv_dir: Path) -> Path:
    return venv_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _read_marker(marker: Path) -> list[str] | None:
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        return None


def _run_logged(command: list[str], what: str, venv_dir: Path, timeout_s: float) -> None:
    """Run `command`, logging pip's package lines as progress and keeping the rest for the error."""
    failure = f"kvpress could not be installed in {venv_dir}: {what}"
    lines: list[str] = []
    try:
        returncode = run_streaming(command, timeout_s, lambda line: _collect(line, lines), merge_stdout=True)
    except OSError as error:
        raise KvpressUnavailable(f"{failure}: {error}") from error
    except subprocess.TimeoutExpired as error:
        raise KvpressUnavailable(f"{failure}: timed out after {timeout_s:.0f} s; {_last_line(lines)}") from error
    if returncode != 0:
        raise KvpressUnavailable(f"{failure}: {_last_line(lines) or f'exit code {returncode}'}")


def run_streaming(command: list[str], timeout_s: float, handle_line, merge_stdout: bool = False) -> int:
    """Run `command`, handing each line of its stderr (and stdout, if merged) to `handle_line` as it
    comes; its exit code. Past `timeout_s` it is killed and subprocess.TimeoutExpired raised."""
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if merge_stdout else subprocess.DEVNULL,
        stderr=subprocess.STDOUT if merge_stdout else subprocess.PIPE,
        text=True,
    )
    stream = process.stdout if merge_stdout else process.stderr

    def drain():
        for line in stream:
            handle_line(line.rstrip())

    # a thread drains the pipe, so the wait below can hold the deadline while output streams
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    finally:
        reader.join(timeout=5)


def _collect(line: str, lines: list[str]) -> None:
    lines.append(line)
    if line.startswith(("Collecting ", "Installing collected packages", "Successfully installed")):
        log.info("kvpress: %s", line[:200])
    else:
        log.debug("kvpress: %s", line)


def _last_line(lines: list[str]) -> str:
    """pip's last ERROR line (its summary of what failed), else its last non-empty line."""
    meaningful = [line.strip() for line in lines if line.strip()]
    errors = [line for line in meaningful if line.startswith("ERROR:")]
    return (errors or meaningful or [""])[-1]
