"""Files `kvwise calibrate` makes for one set of weights, named by the weights' fingerprint.

Each kind (profile, kvzap surrogate, low-rank basis) is looked up the same way: a path the user
names (which must be for these weights), else the user's own from `kvwise calibrate` under
`$KVWISE_HOME/profiles`, else one shipped with the package for the embedded model.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import TypeVar

from kvwise.core.home import kvwise_home

Loaded = TypeVar("Loaded")


def calibrated_path(fingerprint: str, suffix: str) -> Path:
    """Where `kvwise calibrate` writes the file of kind `suffix` (".json", ".kvzap.safetensors", ...)."""
    return kvwise_home() / "profiles" / f"{fingerprint}{suffix}"


def find_calibrated(
    fingerprint: str,
    suffix: str,
    load: Callable[[Path], Loaded],
    what: str,
    path: str | Path | None = None,
) -> Loaded | None:
    """The file of kind `suffix` for these weights, loaded; None when there is none.

    `what` names the kind in the error for a `path` made on other weights ("the profile was
    calibrated"). Loaded objects carry a `fingerprint` attribute.
    """
    if path is not None:
        found = load(Path(path))
        if found.fingerprint != fingerprint:
            raise ValueError(
                f"{what.format(path=path)} on other weights (fingerprint {found.fingerprint}, this model's is "
                f"{fingerprint}); run `kvwise calibrate` on this model"
            )
        return found
    user = calibrated_path(fingerprint, suffix)
    if user.exists():
        return load(user)
    shipped = resources.files("kvwise.adaptive") / "profiles" / f"{fingerprint}{suffix}"
    if shipped.is_file():
        with resources.as_file(shipped) as local:
            return load(Path(local))
    return None
