"""Resumable runs (benches, calibration): rows stream to `NAME.partial.jsonl` (a config header, then one row a line)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def read_partial(path: Path, compatible: Callable[[dict], bool], key_of: Callable[[dict], object]) -> dict:
    """Rows of an interrupted run, keyed by `key_of(row)`, if its header config passes `compatible`.

    An incompatible or unreadable file is deleted; a last line cut short by the interruption is skipped.
    """
    if not path.exists():
        return {}
    lines = path.read_text().splitlines()
    try:
        header = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        header = None
    if header is None or not compatible(header.get("config", {})):
        path.unlink()
        return {}
    done = {}
    for line in lines[1:]:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        done[key_of(row)] = row
    return done
