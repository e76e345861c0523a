"""`kvwise bench niah --compare kvpress[:PRESS,...]`: NVIDIA kvpress on the same NIAH trials.

kvpress runs in its own virtualenv (`kvpress_venv`) through `kvpress_runner.py`, a standalone
script: kvwise saves the model once, hands the runner the trials' token ids, and turns the
runner's JSON lines into rows shaped like `niah.run_trial`'s, policy `kvpress:<Press>`.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from pathlib import Path

from kvwise.bench.kvpress_venv import KVPRESS, kvpress_python
from kvwise.hf.cache import full_kv_bytes

log = logging.getLogger("kvwise.bench")

DEFAULT_PRESSES = ["KVzipPress", "SnapKVPress", "StreamingLLMPress", "ExpectedAttentionPress"]
RUNNER_PATH = Path(__file__).with_name("kvpress_runner.py")
# the runner's limit: loading torch and the model, then each (trial, press, ratio) in proportion
# to its tokens; generous, since KVzipPress replays the context and a CPU may be shared
STARTUP_TIMEOUT_S = 300
TIMEOUT_PER_1K_TOKENS_S = 60
PROGRESS_LINE = re.compile(r"kvpress \d+/\d+: ")


def parse_compare(text: str) -> list[str]:
    """The presses of `--compare`: "kvpress" (the default four) or "kvpress:KVzipPress,SnapKVPress"."""
    usage = "--compare takes 'kvpress' or 'kvpress:PRESS,...' with kvpress class names, e.g. kvpress:KVzipPress"
    peer, separator, names = text.strip().partition(":")
    if peer != "kvpress":
        raise ValueError(f"{usage}; got {text!r}")
    if not separator:
        return list(DEFAULT_PRESSES)
    presses = [name.strip() for name in names.split(",")]
    if not all(name.isidentifier() for name in presses):
        raise ValueError(f"{usage}; got {text!r}")
    if len(set(presses)) != len(presses):
        raise ValueError(f"--compare names a press twice: {text!r}")
    return presses


def run_kvpress(
    model,
    tokenizer,
    trials_and_prompts: list,
    presses: list[str],
    ratios: list[float],
    mode: str,
    num_new_tokens: int,
    out_dir: Path,
) -> list[dict]:
    """Each (trial, press, ratio) through kvpress; rows like kvwise's NIAH rows.

    trials_and_prompts: (NeedleTrial, NeedlePrompt) pairs; a prompt's `context_ids` and
        `question_ids` are [1, n] int tensors, sent to kvpress as they are.
    The runner's raw lines stay in `out_dir/kvpress.partial.jsonl`. Raises KvpressUnavailable (one
    line) when the virtualenv cannot be made or the runner fails.
    """
    import torch

    python = kvpress_python()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trials_path, lines_path = out_dir / "kvpress.trials.json", out_dir / "kvpress.partial.jsonl"
    lines_path.unlink(missing_ok=True)
    trials = [
        {
            "id": index,
            "context_ids": prompt.context_ids[0].tolist(),
            "question_ids": prompt.question_ids[0].tolist(),
            "key": trial.key,
        }
        for index, (trial, prompt) in enumerate(trials_and_prompts)
    ]
    num_tokens = sum(len(trial["context_ids"]) + len(trial["question_ids"]) for trial in trials)
    timeout_s = STARTUP_TIMEOUT_S + TIMEOUT_PER_1K_TOKENS_S * len(presses) * len(ratios) * (num_tokens / 1000 + 1)
    with tempfile.TemporaryDirectory(prefix="kvwise-kvpress-model-") as model_dir:
        log.info("kvpress: saving the model for the runner to %s", model_dir)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        spec = {
            "model_dir": model_dir,
            "presses": presses,
            "ratios": ratios,
            "mode": mode,
            "num_new_tokens": num_new_tokens,
            "num_threads": torch.get_num_threads(),  # the same as kvwise's trials, for comparable seconds
            "trials": trials,
        }
        trials_path.write_text(json.dumps(spec))
        _run_runner([str(python), "-I", str(RUNNER_PATH), str(trials_path), str(lines_path)], timeout_s)
    measured = [json.loads(line) for line in lines_path.read_text().splitlines() if line.strip()]
    return [_row(model, trials_and_prompts[line["id"]][0], line, mode) for line in measured]


def _run_runner(command: list[str], timeout_s: float) -> None:
    KVPRESS.run_runner(command, timeout_s, PROGRESS_LINE)


def _row(model, trial, line: dict, mode: str) -> dict:
    num_compressed = line["compressed_tokens"]
    return {
        "policy": f"kvpress:{line['press']}",
        "ratio": line["ratio"],
        "length": trial.length,
        "depth": trial.depth,
        "trial": trial.trial,
        "key": trial.key,
        "mode": mode,
        "quant": None,
        "engine": False,
        "correct": str(trial.key) in line["answer"],
        "kv_bytes": line["kv_bytes"],
        "full_kv_bytes": full_kv_bytes(model, num_compressed, model.dtype.itemsize),
        "full16_kv_bytes": full_kv_bytes(model, num_compressed, 2),
        "compressed_tokens": num_compressed,
        "seconds": line["seconds"],
        "answer": line["answer"],
        "kvpress_version": line["kvpress_version"],
    }
