"""Building the CPU kernel: failures fall back to SDPA once, a stale torch lock cannot hang us."""

from __future__ import annotations

import pytest

from kvwise.engine import cpu_kernel


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWISE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_kernel, "_has_vector_units", lambda: True)
    cpu_kernel.cpu_kernels.cache_clear()
    yield tmp_path
    cpu_kernel.cpu_kernels.cache_clear()


def test_a_failed_build_falls_back_and_is_not_retried(fresh, monkeypatch):
    calls = []

    def broken(build, flags):
        calls.append(build)
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(cpu_kernel, "_load", broken)
    with pytest.warns(UserWarning, match="using SDPA"):
        assert cpu_kernel.paged_decode_kernel() is None
    (failed,) = fresh.glob("kernels/*/FAILED")
    assert "command not found" in failed.read_text()
    cpu_kernel.cpu_kernels.cache_clear()  # a new process
    with pytest.warns(UserWarning, match="failed to build before"):
        assert cpu_kernel.paged_decode_kernel() is None
    assert len(calls) == 1


def test_a_stale_torch_lock_is_cleared_under_our_lock(fresh, monkeypatch):
    from torch.utils import cpp_extension

    seen = {}

    def fake_load(name, sources, build_directory, **kwargs):
        seen["lock"] = (cpu_kernel.Path(build_directory) / "lock").exists()
        return type("Module", (), {"paged_decode": staticmethod(lambda *args: "ran")})

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    build = fresh / "kernels" / cpu_kernel._digest(cpu_kernel.FLAGS)
    build.mkdir(parents=True)
    (build / "lock").write_text("")  # left by a process killed mid-build
    assert cpu_kernel.paged_decode_kernel()() == "ran"
    assert seen["lock"] is False


def test_switched_off_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv("KVWISE_CPU_KERNEL", "0")
    assert cpu_kernel.paged_decode_kernel() is None


@pytest.fixture
def kernels_reloaded_after():
    """The command clears the kernels' cache and, switched off, caches None: the tests after this
    one load the kernels again rather than run on SDPA unawares."""
    yield
    cpu_kernel.cpu_kernels.cache_clear()


def test_build_kernels_command_says_what_decode_runs_on(capsys, monkeypatch, kernels_reloaded_after):
    from kvwise.cli import main
    from kvwise.engine.cpu_kernel import cpu_kernels

    built = cpu_kernels() is not None
    assert main(["build-kernels"]) == (0 if built else 1)
    said = capsys.readouterr().out
    assert ("CPU kernels ready" in said) if built else ("SDPA" in said)
    monkeypatch.setenv("KVWISE_CPU_KERNEL", "0")
    assert main(["build-kernels"]) in (0, 1)
    assert "CPU kernels off (KVWISE_CPU_KERNEL=0)" in capsys.readouterr().out
