"""`kvwise serve --replicas` refuses what cannot work before anything starts: no replicas, more
than the memory holds, flags a replica would refuse, the cluster extra missing."""

from __future__ import annotations

import importlib

import pytest

from kvwise.cli import build_parser, main
from kvwise.cluster import launch
from kvwise.util.extras import MissingExtra

GIB = 1 << 30


def _args(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_zero_replicas_is_refused_before_ray_starts(capsys):
    assert main(["serve", "--replicas", "0"]) == 2
    assert "--replicas must be at least 1" in capsys.readouterr().err


def test_ray_address_without_replicas_is_refused(capsys):
    assert main(["serve", "--ray-address", "auto"]) == 2
    assert "give --replicas N too" in capsys.readouterr().err


def test_more_replicas_than_memory_holds_is_refused_with_the_arithmetic():
    args = _args("--kv-cache-memory", "2GiB")
    launch.check_fits(args, 2, available=8 * GIB)  # 2 x (0.53 + 2) GiB fits in 8
    with pytest.raises(ValueError, match=r"3 replicas need about 7\.6 GiB .* but 6\.0 GiB is available"):
        launch.check_fits(args, 3, available=6 * GIB)


def test_the_cpu_default_splits_a_quarter_of_free_ram_between_replicas(monkeypatch):
    monkeypatch.setattr(launch, "_available_memory", lambda: 16 * GIB)
    monkeypatch.setattr(launch, "_cuda", lambda: False)
    copied = launch.per_replica_args(_args("--device", "cpu"), 4)
    assert copied.kv_cache_memory == GIB and copied.replicas == 4  # 16 GiB / (4 x 4)
    assert launch.per_replica_args(_args("--device", "cpu", "--num-blocks", "64"), 4).kv_cache_memory is None


def test_flags_a_replica_would_refuse_are_refused_once_in_the_front_door(tmp_path, monkeypatch):
    monkeypatch.delenv("KVWISE_REDIS_HMAC_KEY", raising=False)
    monkeypatch.delenv("KVWISE_REDIS_KEY", raising=False)
    args = _args("--redis-url", "redis+cluster://127.0.0.1:1", "--namespace-key-file", str(tmp_path / "ns"))
    (tmp_path / "ns").write_text("ab" * 32)
    keys = launch.cluster_keys(args)
    with pytest.raises(ValueError, match="HMAC key or an encryption key"):
        launch.check_flags(args, keys)
    monkeypatch.setenv("KVWISE_REDIS_HMAC_KEY", "from-the-environment")
    keys = launch.cluster_keys(args)
    assert keys.redis_hmac == ["from-the-environment"]  # carried to replicas on other nodes
    launch.check_flags(args, keys)
    with pytest.raises(ValueError, match="--kv-quality"):
        launch.check_flags(_args("--kv-policy", "auto", "--kv-quality", "2"), keys)


def test_without_the_cluster_extra_one_line_names_the_install(monkeypatch, capsys):
    real = importlib.import_module

    def no_ray(name, *rest):
        if name.startswith("ray"):
            raise ImportError("No module named 'ray'", name="ray")
        return real(name, *rest)

    monkeypatch.setattr(importlib, "import_module", no_ray)
    with pytest.raises(MissingExtra, match=r"pip install 'kvwise\[cluster\]'"):
        launch.deploy(_args(), 2)
    assert main(["serve", "--replicas", "2"]) == 1
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "kvwise[cluster]" in error
