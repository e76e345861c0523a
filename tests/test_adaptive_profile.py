"""`kvwise calibrate` on a tiny model with a character tokenizer and the user's own documents:
a profile keyed by the weights, with a front per class, that resumes after an interruption; and
how a model's profile is found (or refused, naming the command); the machine's costs measured into it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kvwise
import kvwise.adaptive.calibrate as calibrate
from kvwise.adaptive.calibrate import CalibrateConfig, run_calibrate
from kvwise.adaptive.cost_calibration import CostConfig
from kvwise.adaptive.profile import CLASSES, Profile, find_profile, require_profile
from kvwise.kv.lowrank_basis import LowRankBasis
from kvwise.models import load_model
from kvwise.policies.score_surrogate import ScoreSurrogate
from kvwise.util.fingerprint import weights_fingerprint
from tests.tiny_chars_model import save_tiny_llama

pytestmark = pytest.mark.timeout(300)

LENGTHS = {"retrieval": (60, 120), "chat": (40, 80), "long_generation": (20, 40)}
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum old songs ".split()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = save_tiny_llama(tmp_path_factory.mktemp("tiny"))
    return load_model(str(directory), device="cpu")


@pytest.fixture
def documents(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for index in range(3):
        text = " ".join(WORDS[(index * 7 + n * 3) % len(WORDS)] for n in range(400))
        (folder / f"doc{index}.txt").write_text(text)
    return folder


def _config(documents, **overrides):
    settings = dict(
        data=str(documents),
        # a short window: the probes are shorter than kivi4's default 128-token full-precision window
        mixes=("full", "kivi4:residual_length=32", "snapkv@0.5"),
        probes={"retrieval": 2, "chat": 1, "long_generation": 1},
        probe_lengths=LENGTHS,
        cost_config=CostConfig(lengths=(24, 72), batch=2, steps=2, warmup=1, forms=("full", "evicted", "int8")),
    )
    return CalibrateConfig(**{**settings, **overrides})


def test_calibrate_writes_a_profile_keyed_by_the_weights(tiny, documents, tmp_path, monkeypatch):
    monkeypatch.setenv("KVWISE_HOME", str(tmp_path / "home"))
    path = run_calibrate(_config(documents), tmp_path / "out", model=tiny)
    fingerprint = weights_fingerprint(tiny[0])
    assert path.name == f"{fingerprint}.json"
    profile = Profile.load(path)
    assert profile.fingerprint == fingerprint and profile.data.startswith("3 documents")
    assert [entry.mix for entry in profile.mixes] == ["full", "kivi4:residual_length=32", "snapkv@0.5"]
    full = profile.get("full")
    assert full.bytes_fraction == 1.0 and all(full.quality[klass] == 1.0 for klass in CLASSES)
    kivi4, snapkv = profile.get("kivi4:residual_length=32"), profile.get("snapkv@0.5")
    assert kivi4.bytes_fraction < 0.8  # 4-bit codes of float32 values (the window and sink block stay float)
    # half of the compressed prompt, plus what short probes hold beside it in the engine: the last
    # prompt token and the generated ones, and each head's last head page partly filled
    assert 0.45 < snapkv.bytes_fraction < 0.65
    for klass in CLASSES:
        front = profile.front(klass)
        assert front[-1].quality[klass] == 1.0  # nothing beats full's quality; something is cheaper on the front
        assert [e.bytes_fraction for e in front] == sorted(e.bytes_fraction for e in front)
        assert all(0.0 <= entry.quality[klass] <= 1.0 for entry in profile.mixes)
    table = path.with_suffix(".md").read_text()
    assert "| snapkv@0.5 |" in table and "on the front of" in table
    assert not (path.parent / f"{fingerprint}.partial.jsonl").exists()
    surrogate = ScoreSurrogate.load(path.parent / f"{fingerprint}.kvzap.safetensors")  # kvzap's, beside it
    assert surrogate.fingerprint == fingerprint and set(surrogate.info["agreement"]) == {"0.75", "0.9", "0.95"}
    basis = LowRankBasis.load(path.parent / f"{fingerprint}.lowrank.safetensors")  # the low-rank codec's, too
    assert basis.fingerprint == fingerprint and set(basis.info["held_out_relative_error"]) == {"keys", "values"}
    # the user's profile directory is where auto looks first
    assert find_profile(fingerprint, path).fingerprint == fingerprint
    # how it was made, enough to make it again
    made = profile.provenance
    assert made.seed == 0 and made.probes == profile.probes == {"retrieval": 2, "chat": 1, "long_generation": 1}
    assert made.data == profile.data and made.dtype == "float32" and made.device.startswith("cpu: ")
    assert made.kvwise == kvwise.__version__ and made.date.startswith("20") and made.torch == torch.__version__
    assert made.command.startswith("run_calibrate(CalibrateConfig(") and "data=" in made.command
    assert f"Made by `{made.command}`" in table
    # what actions cost on this machine, measured into the profile, with the machine named
    costs = profile.costs
    assert set(costs.forms) == {"full", "evicted", "int8"} and costs.dtype == "float32"
    assert costs.machine and costs.base >= 0 and costs.prefill_seconds_per_token > 0
    assert all(cost.per_request >= 0 and cost.per_byte >= 0 for cost in costs.forms.values())
    assert "Machine costs (" in table and "| int8 |" in table.split("Machine costs")[1]


def test_costs_only_measures_into_the_profile_there_and_keeps_its_mixes(tiny, documents, tmp_path):
    with pytest.raises(ValueError, match="no profile at .* run `kvwise calibrate` without --costs-only"):
        run_calibrate(_config(documents, costs="only"), tmp_path, model=tiny)
    path = run_calibrate(_config(documents, costs="skip", surrogate="skip"), tmp_path, model=tiny)
    before = Profile.load(path)
    assert before.costs is None
    assert run_calibrate(_config(documents, costs="only"), tmp_path, model=tiny) == path
    after = Profile.load(path)
    assert after.costs is not None and after.mixes == before.mixes and after.provenance == before.provenance
    data = json.loads(path.read_text())
    data["costs"]["forms"] = {"int8": {"per_request": 0.0, "per_byte": 0.0}}  # no full: nothing to fall back on
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="machine costs do not read: .*'full' form"):
        Profile.load(path)


def test_an_interrupted_calibration_resumes(tiny, documents, tmp_path, monkeypatch):
    # per mix: all its probes in one engine batch (4 rows); the run is cut when the third mix's
    # batch starts
    rows, stop_at = [], 8
    real_probe, real_engine = calibrate.measure_probe, calibrate.measure_in_engine

    def probe(*args):
        rows.append(args[2].spec)
        return real_probe(*args)

    def engine(model, tokenizer, mix, probes):
        if len(rows) >= stop_at:
            raise KeyboardInterrupt
        rows.extend([mix] * len(probes))
        return real_engine(model, tokenizer, mix, probes)

    monkeypatch.setattr(calibrate, "measure_probe", probe)
    monkeypatch.setattr(calibrate, "measure_in_engine", engine)
    with pytest.raises(KeyboardInterrupt):
        run_calibrate(_config(documents), tmp_path, model=tiny)
    assert len(rows) == 8
    rows.clear()
    stop_at = 10**6
    run_calibrate(_config(documents), tmp_path, model=tiny)
    assert rows == ["snapkv@0.5"] * 4  # only what the first run had not measured


def test_a_budget_in_minutes_stops_starting_mixes(tiny, documents, tmp_path, monkeypatch):
    clock = iter(range(0, 10_000, 100))  # each reading of the clock: 100 s later
    monkeypatch.setattr(calibrate.time, "monotonic", lambda: next(clock))
    path = run_calibrate(_config(documents, budget_minutes=1), tmp_path, model=tiny)
    assert [entry.mix for entry in Profile.load(path).mixes] == ["full"]


def test_profiles_are_found_by_fingerprint_or_refused_by_name(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("KVWISE_HOME", str(tmp_path))
    model = tiny[0]
    with pytest.raises(ValueError, match="kvwise calibrate"):
        require_profile(model)
    other = tmp_path / "other.json"
    fields = {"mix": "full", "bytes_fraction": 1.0, "extra_seconds_per_token": 0.0}
    profile = {"model": "m", "fingerprint": "f" * 32, "full_bytes_per_token": 4, "format": 1}
    other.write_text(json.dumps({**profile, "mixes": [{**fields, "quality": dict.fromkeys(CLASSES, 1.0)}]}))
    with pytest.raises(ValueError, match="calibrated on other weights"):
        require_profile(model, other)
    other.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the profile"):
        require_profile(model, other)


def test_bad_calibration_options_are_refused(documents):
    with pytest.raises(ValueError, match="unknown component 'zip@3'"):
        CalibrateConfig(mixes=("full", "zip@3"))
    with pytest.raises(ValueError, match="--budget-minutes must be positive"):
        CalibrateConfig(budget_minutes=0)
    with pytest.raises(ValueError, match="costs must be 'measure', 'skip' or 'only'"):
        CalibrateConfig(costs="guess")
    with pytest.raises(ValueError, match="cost lengths are two increasing token counts"):
        CostConfig(lengths=(100, 50))
    with pytest.raises(ValueError, match="no .txt or .md files"):
        from kvwise.adaptive.probes import calibration_text

        calibration_text(documents.parent / "empty" if (documents.parent / "empty").mkdir() is None else None)


def test_the_shipped_profile_is_what_calibrate_writes_with_its_provenance():
    """The embedded model's profile in the package was made by `kvwise calibrate` with its defaults,
    and says so: every default mix on every default probe, and the command that made it."""
    shipped = sorted((Path(calibrate.__file__).parent / "profiles").glob("*.json"))
    assert len(shipped) == 1
    profile = Profile.load(shipped[0])
    assert [entry.mix for entry in profile.mixes] == list(calibrate.DEFAULT_MIXES)
    assert profile.probes == calibrate.PROBES
    made = profile.provenance
    assert made is not None and made.command == "kvwise calibrate --out src/kvwise/adaptive/profiles"
    assert made.seed == 0 and made.probes == calibrate.PROBES and made.data == profile.data
    assert shipped[0].with_suffix(".md").read_text().count("Made by `kvwise calibrate") == 1
