"""The bench fronts: `--quick` and each flag reach the config a bench runs with."""

from __future__ import annotations

import pytest

from kvwise.bench import commands
from kvwise.cli import build_parser

pytestmark = pytest.mark.timeout(60)


def _configs_run_with(monkeypatch, argv: list[str]):
    """Parse `kvwise bench ...` and return the config its run got, without running it."""
    seen = []
    monkeypatch.setattr(commands, "_bench_attribute", _capturing(seen))
    monkeypatch.setattr(commands, "_print_report", lambda out, name: None)
    commands.run_bench(build_parser().parse_args(["bench", *argv]))
    return seen


def _capturing(seen):
    real = commands._bench_attribute

    def attribute(path: str):
        if ":run" not in path:
            return real(path)
        return lambda config, out: seen.append(config)

    return attribute


@pytest.mark.parametrize("name", [name for name in commands.TABLE if name != "cluster"])
def test_quick_sets_each_table_bench_config(monkeypatch, tmp_path, name):
    (config,) = _configs_run_with(monkeypatch, [name, "--quick", "--out", str(tmp_path)])
    for field, value in commands.TABLE[name].quick.items():
        assert getattr(config, field) == value


def test_flags_override_quick_and_lists_become_tuples(monkeypatch, tmp_path):
    argv = ["throughput", "--quick", "--requests", "3", "--systems", "kvwise", "--dtype", "bfloat16"]
    (config,) = _configs_run_with(monkeypatch, [*argv, "--out", str(tmp_path)])
    assert (config.requests, config.systems, config.dtype) == (3, ("kvwise",), "bfloat16")
    assert config.new_tokens == commands.TABLE["throughput"].quick["new_tokens"]


def test_flags_with_another_dest_reach_their_field(monkeypatch, tmp_path):
    (load,) = _configs_run_with(monkeypatch, ["load", "--duration", "2.5", "--tier-faults", "--out", str(tmp_path)])
    assert (load.duration_seconds, load.tier_faults) == (2.5, True)
    (isolation,) = _configs_run_with(monkeypatch, ["isolation", "--flood-only", "--out", str(tmp_path)])
    assert isolation.probes is False
    (default,) = _configs_run_with(monkeypatch, ["isolation", "--out", str(tmp_path)])
    assert default.probes is True


def test_a_bad_flag_value_is_refused_by_the_config(monkeypatch, tmp_path):
    with pytest.raises(ValueError):
        _configs_run_with(monkeypatch, ["throughput", "--requests", "0", "--out", str(tmp_path)])


def test_ppl_quick_settings_are_a_valid_config(monkeypatch, tmp_path):
    from kvwise.bench import ppl

    seen = []
    monkeypatch.setattr(ppl, "run_ppl", lambda config, out, resume: seen.append(config) or {"results": []})
    (tmp_path / "ppl.md").write_text("")
    commands.run_bench(build_parser().parse_args(["bench", "ppl", "--quick", "--out", str(tmp_path)]))
    assert seen[0].mixes == ["h2o@max=256+kivi4"]


def test_the_adaptive_bench_takes_a_workload_and_refuses_flags_of_another(monkeypatch, tmp_path):
    import kvwise.bench.adaptive as adaptive

    seen = []
    monkeypatch.setattr(adaptive, "run_adaptive_bench", lambda config, out, resume: seen.append(config))
    monkeypatch.setattr(commands, "_print_report", lambda out, name: None)
    argv = ["bench", "adaptive", "--workload", "long-chat", "--quick", "--conversations", "3", "--out", str(tmp_path)]
    commands.run_bench(build_parser().parse_args(argv))
    (config,) = seen
    assert type(config.workload).__name__ == "LongChatSpec" and config.workload.conversations == 3
    assert config.workload.history_tokens == (2000, 3500)  # --quick's
    with pytest.raises(SystemExit, match="--requests does not apply to the long-chat workload"):
        argv = ["bench", "adaptive", "--workload", "long-chat", "--requests", "4"]
        commands.run_bench(build_parser().parse_args(argv))
    with pytest.raises(SystemExit, match="--turns does not apply to the mixed workload"):
        commands.run_bench(build_parser().parse_args(["bench", "adaptive", "--turns", "4"]))
