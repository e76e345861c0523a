"""A calibration profile: what each KV mix keeps and costs on one model, per request class.

`kvwise calibrate` measures it (`adaptive.calibrate`); the controller reads it to pick, per
request, the cheapest mix whose predicted quality meets a floor. A profile is keyed by the
fingerprint of the model's weights (`util.fingerprint`), so the same weights in another dtype or
on another device share it, and a retrained checkpoint does not.

Quality is relative to the full cache on the same probes, in [0, 1], per class:
- retrieval: accuracy / the full cache's accuracy;
- chat: mean of min(1, full's perplexity / this perplexity) on the text that follows a context;
- long_generation: fraction of the first 32 greedy tokens equal to the full cache's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvwise.adaptive.costs import MachineCosts
from kvwise.policies.mix import parse_mix
from kvwise.util.calibrated import calibrated_path, find_calibrated
from kvwise.util.pareto import pareto_front

CLASSES = ("retrieval", "chat", "long_generation")
FORMAT = 1


@dataclass
class MixProfile:
    """One mix's measurements. bytes_fraction: KV bytes after the mix / the full cache's on the same
    probes (summed over them); extra_seconds_per_token: wall time per prompt token over full's
    (a reconstruction pass, quantization); quality: class -> relative quality in [0, 1]; details:
    class -> the raw figures (accuracy, perplexity ratio, agreement, probes)."""

    mix: str
    bytes_fraction: float
    extra_seconds_per_token: float
    quality: dict[str, float]
    details: dict[str, dict] = field(default_factory=dict)

    @property
    def quant(self) -> str | None:
        return parse_mix(self.mix).quant


@dataclass(frozen=True)
class Provenance:
    """How a profile was made, enough to make it again: kvwise's version, the UTC date (ISO 8601),
    the command as typed (or the Python call), the probe seed, what the probe text came from, the
    probes per class, and what it ran on (the model's dtype, the device, torch's version)."""

    kvwise: str
    date: str
    command: str
    seed: int
    data: str
    probes: dict[str, int]
    dtype: str
    device: str
    torch: str


@dataclass
class Profile:
    model: str
    fingerprint: str
    full_bytes_per_token: int  # the full cache's KV bytes per token at the dtype calibrated
    mixes: list[MixProfile]
    data: str = "built-in essays"  # what the probes were made from
    probes: dict[str, int] = field(default_factory=dict)  # class -> probes per mix
    format: int = FORMAT
    provenance: Provenance | None = None  # None in a profile written before kvwise recorded it
    costs: MachineCosts | None = None  # what actions cost on the machine calibrated (None: not measured)

    # ---- reads -----------------------------------------------------------------------------------
    def get(self, mix: str) -> MixProfile | None:
        spec = parse_mix(mix).spec
        return next((entry for entry in self.mixes if parse_mix(entry.mix).spec == spec), None)

    def front(self, klass: str) -> list[MixProfile]:
        """The Pareto front of `klass`: mixes no other beats on both bytes and quality, cheapest first."""
        check_class(klass)
        return pareto_front(self.mixes, lambda entry: entry.bytes_fraction, lambda entry: entry.quality[klass])

    def cheapest(self, klass: str, floor: float, allowed=None) -> MixProfile:
        """The mix with the fewest bytes whose quality for `klass` is at least `floor` (ties: the
        faster one); `allowed(entry)` filters candidates. `full` always qualifies."""
        check_class(klass)
        candidates = [
            entry
            for entry in self.mixes
            if entry.quality[klass] >= floor and (allowed is None or allowed(entry)) or entry.mix == "full"
        ]
        return min(candidates, key=lambda entry: (entry.bytes_fraction, entry.extra_seconds_per_token))

    # ---- files -----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        if data.get("format") != FORMAT:
            raise ValueError(f"profile format {data.get('format')!r} is not {FORMAT}; run `kvwise calibrate` again")
        mixes = [MixProfile(**entry) for entry in data["mixes"]]
        for entry in mixes:
            parse_mix(entry.mix)
            missing = [klass for klass in CLASSES if klass not in entry.quality]
            if missing:
                raise ValueError(f"profile entry {entry.mix!r} has no quality for {', '.join(missing)}")
        if not any(entry.mix == "full" for entry in mixes):
            raise ValueError("a profile must measure the 'full' mix, the reference of every quality")
        provenance = data.get("provenance")
        if provenance is not None:
            try:
                provenance = Provenance(**provenance)
            except TypeError as error:
                raise ValueError(f"the profile's provenance does not read: {error}") from None
        costs = data.get("costs")
        if costs is not None:
            try:
                costs = MachineCosts(**costs)
            except (TypeError, ValueError) as error:
                raise ValueError(f"the profile's machine costs do not read: {error}") from None
        return cls(**{**data, "mixes": mixes, "provenance": provenance, "costs": costs})

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read the profile {path}: {error}") from None
        return cls.from_json(data)


def check_class(klass: str) -> str:
    if klass not in CLASSES:
        raise ValueError(f"unknown request class {klass!r}; choose from: {', '.join(CLASSES)}")
    return klass


def user_profile_path(fingerprint: str) -> Path:
    """Where `kvwise calibrate` writes a model's profile by default."""
    return calibrated_path(fingerprint, ".json")


def find_profile(fingerprint: str, path: str | Path | None = None) -> Profile | None:
    """The profile for these weights: `path` if given, else the user's (written by `kvwise
    calibrate`), else one shipped with the package; None when there is none."""
    return find_calibrated(fingerprint, ".json", Profile.load, "the profile {path} was calibrated", path)


def require_profile(model, path: str | Path | None = None) -> Profile:
    """The profile of `model`'s weights, or a ValueError naming the command that makes one."""
    from kvwise.util.fingerprint import weights_fingerprint

    fingerprint = weights_fingerprint(model)
    profile = find_profile(fingerprint, path)
    if profile is None:
        raise ValueError(
            f"no KV profile for this model (weights {fingerprint}): run `kvwise calibrate --model <it>` "
            "first (minutes; --quick for fewer), or start the server with --kv-calibrate-on-start"
        )
    return profile
