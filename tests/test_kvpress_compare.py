"""`--compare kvpress`: the flag's parsing and the failure paths (the real install needs the network)."""

import sys

import pytest

from kvwise.bench.kvpress_compare import DEFAULT_PRESSES, _run_runner, parse_compare
from kvwise.bench.kvpress_venv import KVPRESS, MARKER_NAME, KvpressUnavailable, kvpress_python
from tests.peer_venv_helpers import without_an_index


def test_parse_compare_defaults_and_named_presses():
    assert parse_compare("kvpress") == DEFAULT_PRESSES
    assert parse_compare("kvpress:KVzipPress,SnapKVPress") == ["KVzipPress", "SnapKVPress"]
    assert parse_compare(" kvpress:KVzipPress, SnapKVPress ") == ["KVzipPress", "SnapKVPress"]


@pytest.mark.parametrize(
    "text", ["", "snapkv", "kvpres", "other:SnapKVPress", "kvpress:", "kvpress:Snap KV", "kvpress:A,,B", "kvpress:A,A"]
)
def test_parse_compare_rejects_other_values(text):
    with pytest.raises(ValueError, match="compare"):
        parse_compare(text)


@pytest.fixture
def unreachable_index(tmp_path, monkeypatch):
    return without_an_index(monkeypatch, tmp_path, KVPRESS)


@pytest.mark.timeout(180)
def test_failed_install_raises_one_line_and_is_retried(unreachable_index):
    venv_dir = unreachable_index
    with pytest.raises(KvpressUnavailable) as first:
        kvpress_python()
    message = str(first.value)
    assert "\n" not in message
    assert message.startswith(f"kvpress could not be installed in {venv_dir}: pip: ")
    assert message != f"kvpress could not be installed in {venv_dir}: pip: "  # names what pip said
    assert (venv_dir / "bin" / "python").exists() and not (venv_dir / MARKER_NAME).exists()

    # the half-made venv has a python; a second call must rebuild it, not take it as installed
    leftover = venv_dir / "left-from-the-failed-install"
    leftover.write_text("")
    with pytest.raises(KvpressUnavailable, match="pip: "):
        kvpress_python()
    assert not leftover.exists() and not (venv_dir / MARKER_NAME).exists()


@pytest.mark.timeout(60)
def test_runner_crash_raises_its_last_stderr_line():
    crash = (
        "import sys; print('kvpress 1/2: trial 0 SnapKVPress ratio=0.5 1.00 s', file=sys.stderr);"
        "print('kvpress runner failed: ValueError: boom', file=sys.stderr); sys.exit(1)"
    )
    with pytest.raises(KvpressUnavailable) as failure:
        _run_runner([sys.executable, "-c", crash], timeout_s=50)
    assert str(failure.value) == "the kvpress runner failed (exit code 1): kvpress runner failed: ValueError: boom"


@pytest.mark.timeout(30)
def test_runner_past_its_limit_is_stopped():
    with pytest.raises(KvpressUnavailable, match="ran past its 1 s limit"):
        _run_runner([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=1)
