"""Files `kvwise calibrate` makes for one set of weights, named by the weights' fingerprint.

Each kind (profile, kvzap surrogate, low-rank basis) is looked up the same way: a path the user
names (which must be for these weights), else the user's own from `kvwise calibrate` under
`$KVWISE_HOME/profiles`, else one shipped with the package for the embedded model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import TypeVar

from kvwise.util.home import kvwise_home

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


def save_layered(path: str | Path, fingerprint: str, layers: dict, info: dict) -> Path:
    """Per-layer tensors as safetensors ("layer{i}.{name}", float32), fingerprint and info as metadata."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"layer{index}.{name}": tensor.contiguous().float()
        for index, by_name in layers.items()
        for name, tensor in by_name.items()
    }
    save_file(tensors, str(path), metadata={"fingerprint": fingerprint, "info": json.dumps(info)})
    return path


def load_layered(path: str | Path, what: str) -> tuple[str, dict, dict]:
    """(fingerprint, layer -> name -> tensor, info) of a `save_layered` file; a ValueError saying
    `path` is not `what` for a truncated or foreign file."""
    from safetensors import safe_open

    layers: dict = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            for key in handle.keys():
                layer, _, name = key.partition(".")
                layers.setdefault(int(layer.removeprefix("layer")), {})[name] = handle.get_tensor(key)
    except Exception as error:  # a truncated or foreign file: name it, never guess
        raise ValueError(f"{path} is not {what}: {error}") from None
    if "fingerprint" not in metadata:
        raise ValueError(f"{path} is not {what}: no fingerprint in its metadata")
    return metadata["fingerprint"], layers, json.loads(metadata.get("info", "{}"))
