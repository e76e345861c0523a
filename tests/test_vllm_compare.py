"""`--compare vllm`: the flag, the fairness settings, the greedy agreement, and the failure paths
(the real vLLM needs its multi-GB virtualenv, which CI does not build)."""

import json
import os
import subprocess
import sys

import pytest

from kvwise.bench.peer_venv import MARKER_NAME
from kvwise.bench.rag import RagConfig
from kvwise.bench.throughput import ThroughputConfig, run_throughput
from kvwise.bench.vllm_compare import (
    RUNNER_PATH,
    VLLM,
    VllmUnavailable,
    _run_runner,
    greedy_agreement,
    parse_compare,
    thread_environment,
    vllm_settings,
)
from tests.peer_venv_helpers import without_an_index


def test_parse_compare_takes_vllm_only():
    assert parse_compare("vllm") == "vllm" and parse_compare(" VLLM ") == "vllm"
    assert parse_compare(None) is None
    for text in ("", "kvpress", "vllm:foo", "sglang"):
        with pytest.raises(ValueError, match="--compare takes 'vllm'"):
            parse_compare(text)


def test_configs_check_compare_and_keep_the_row_vllm_is_set_against():
    assert ThroughputConfig(systems=("hf-sequential",), compare="vllm").systems == ("hf-sequential", "kvwise")
    assert RagConfig(systems=("hf-sequential",), compare="vllm").systems == ("hf-sequential", "kvwise-reuse-on")
    with pytest.raises(ValueError, match="--compare"):
        ThroughputConfig(compare="kvpress")


def test_vllm_settings_try_kvwise_limits_beside_the_defaults():
    defaults, limits = vllm_settings(max_running=64, token_budget=2048, prefix_caching=True, max_model_len=1100)
    assert defaults.name == "vllm" and "max_num_seqs" not in defaults.engine_args
    assert limits.engine_args == {
        "enable_prefix_caching": True,
        "max_model_len": 1100,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 2048,
    }


def test_vllm_is_bound_to_as_many_cpus_as_kvwise_uses_and_reserves_none():
    allowed = sorted(os.sched_getaffinity(0))
    environment = thread_environment(1)
    assert environment["VLLM_CPU_OMP_THREADS_BIND"] == str(allowed[0])
    assert environment["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and environment["OMP_NUM_THREADS"] == "1"
    assert thread_environment(len(allowed) + 5)["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, allowed))


def test_greedy_agreement_counts_equal_prefixes_and_near_ties():
    vllm = [
        {"tokens": [1, 2, 3, 4], "top_logprobs": [[-0.1, -3.0]] * 4},
        {"tokens": [1, 2, 3, 4], "top_logprobs": [[-0.1, -3.0], [-0.6930, -0.6935], [-0.1, -3.0], [-0.1, -3.0]]},
        {"tokens": [5, 6, 7, 8], "top_logprobs": [[-0.1, -3.0]] * 4},
    ]
    ours = [[1, 2, 3, 4, 9], [1, 7, 3, 4], [5, 6, 0, 8]]
    agreement = greedy_agreement(ours, vllm, tokens=4, tie=1e-3)
    assert agreement["same"] == 1 and agreement["requests"] == 3
    assert agreement["divergences_at_near_ties"] == 1  # request 1 at a 5e-4 gap; request 2 at a 2.9 gap
    assert [(d["request"], d["position"]) for d in agreement["divergences"]] == [(1, 1), (2, 2)]
    assert agreement["divergences"][0]["vllm_top2_gap"] == pytest.approx(5e-4, abs=1e-6)


@pytest.fixture
def unreachable_index(tmp_path, monkeypatch):
    return without_an_index(monkeypatch, tmp_path, VLLM)


@pytest.mark.timeout(180)
def test_a_failed_install_stops_the_bench_before_it_measures(unreachable_index, tmp_path):
    with pytest.raises(VllmUnavailable) as failure:
        # a model that does not exist: the bench must stop at the install, before loading anything
        run_throughput(ThroughputConfig(model=str(tmp_path / "no-model"), compare="vllm"), tmp_path / "out")
    message = str(failure.value)
    assert "\n" not in message
    assert message.startswith(f"vllm could not be installed in {unreachable_index}: pip: ")
    assert not (unreachable_index / MARKER_NAME).exists() and not (tmp_path / "out").exists()


@pytest.mark.timeout(60)
def test_runner_crash_raises_its_failure_line():
    crash = (
        "import sys; print('vllm 1/2: request 0 1.00 s', file=sys.stderr);"
        "print('vllm runner failed: ValueError: boom', file=sys.stderr);"
        "print('INFO shutting down', file=sys.stderr); sys.exit(1)"
    )
    with pytest.raises(VllmUnavailable) as failure:
        _run_runner([sys.executable, "-c", crash], timeout_s=50)
    assert str(failure.value) == "the vllm runner failed (exit code 1): vllm runner failed: ValueError: boom"


@pytest.mark.timeout(30)
def test_runner_past_its_limit_is_stopped():
    with pytest.raises(VllmUnavailable, match="ran past its 1 s limit"):
        _run_runner([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=1)


@pytest.mark.timeout(60)
def test_the_runner_rejects_a_spec_without_its_fields(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model_dir": str(tmp_path), "requests": []}))
    done = subprocess.run(
        [sys.executable, "-I", str(RUNNER_PATH), str(spec), str(tmp_path / "out.json")], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "the spec lacks dtype, new_tokens, warmup_prompt_ids, warmup_tokens"
    assert not (tmp_path / "out.json").exists()


class FakeOutput:
    def __init__(self, request_id, tokens, finished):
        self.request_id, self.finished = request_id, finished
        self.outputs = [type("Completion", (), {"token_ids": tokens})()]


class FakeEngine:
    """vLLM's `add_request`/`step` as the runner uses them: each step adds one token to every
    running request; a request finishes at `new_tokens`."""

    def __init__(self, new_tokens):
        self.new_tokens, self.running, self.added = new_tokens, {}, []

    def add_request(self, request_id, prompt, params):
        self.running[request_id] = []
        self.added.append(request_id)

    def step(self):
        outputs = []
        for request_id, tokens in list(self.running.items()):
            tokens.append(len(tokens))
            finished = len(tokens) == self.new_tokens
            outputs.append(FakeOutput(request_id, list(tokens), finished))
            if finished:
                del self.running[request_id]
        return outputs


def test_the_runner_keeps_each_request_s_first_token_and_finish_and_its_client_limit():
    sys.path.insert(0, str(RUNNER_PATH.parent))
    try:
        from vllm_runner import drive
    finally:
        sys.path.pop(0)
    engine, events = FakeEngine(new_tokens=3), []

    def observe(request_id, event, output):
        events.append((request_id, event, None if output is None else len(output.outputs[0].token_ids)))

    drive(engine, [(str(i), [1, 2]) for i in range(3)], None, 2, observe)
    firsts = [e for e in events if e[1] == "first_token_s"]
    # every step's output has tokens: observe sees each, and keeps the first (vllm_runner.run)
    assert [(r, n) for r, kind, n in events if kind == "finish_s"] == [("0", 3), ("1", 3), ("2", 3)]
    assert len(firsts) == 9 and firsts[0] == ("0", "first_token_s", 1)
    # two clients: the third request is sent only when one of the first two finished
    assert events.index(("2", "arrival_s", None)) > events.index(("0", "finish_s", 3))
    assert engine.added == ["0", "1", "2"]
