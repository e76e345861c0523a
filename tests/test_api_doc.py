"""docs/api.md lists only names that exist: every class, function and method it names imports."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

API = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()


def resolve(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ImportError(dotted)


def test_every_listed_name_exists():
    names = re.findall(r"^### `([\w.]+)`", API, flags=re.MULTILINE)
    methods = re.findall(r"^- `([\w.]+)\(", API, flags=re.MULTILINE)
    assert len(names) >= 20 and len(methods) >= 10
    for dotted in names + methods:
        assert callable(resolve(dotted)), dotted
