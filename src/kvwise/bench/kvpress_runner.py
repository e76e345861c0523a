"""Runs NVIDIA kvpress on kvwise's NIAH trials, inside kvpress's own virtualenv (`kvpress_venv`).

Standalone: it imports only the standard library, torch, transformers and kvpress, never kvwise,
whose transformers is newer than kvpress 0.5.x allows. kvwise hands it token ids, so both sides
read exactly the same prompts.

    python kvpress_runner.py TRIALS_JSON OUT_JSONL

TRIALS_JSON: {"model_dir", "presses": [kvpress class names], "ratios", "mode": "agnostic"|"aware",
"num_new_tokens", "num_threads" (optional), "trials": [{"id", "context_ids", "question_ids", "key"}]}.
OUT_JSONL gets one line per (trial, press, ratio) as it finishes; progress goes to stderr.
Exit code 2: an unknown press or mode (one line naming what is available); 1: a press failed.

Each trial runs kvpress's own `KVPressTextGenerationPipeline._forward` on the ids (it prefills
the context under the press, runs the extra passes of presses such as KVzipPress's
reconstruction, then decodes greedily with explicit positions), timed end to end like kvwise's
`run_trial`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

EXIT_BAD_REQUEST = 2
# kvpress scores these from the attention weights that only eager attention returns; its
# head-wise presses (KVzipPress, AdaKVPress, ...) refuse eager, so the rest run on sdpa
EAGER_PRESSES = {"ObservedAttentionPress"}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: kvpress_runner.py TRIALS_JSON OUT_JSONL", file=sys.stderr)
        return EXIT_BAD_REQUEST
    spec = json.loads(Path(argv[0]).read_text())
    import kvpress

    available = available_presses(kvpress)
    unknown = [name for name in spec["presses"] if name not in available]
    if unknown:
        print(
            f"kvpress {version('kvpress')} has no press {', '.join(unknown)}; available: {', '.join(available)}",
            file=sys.stderr,
        )
        return EXIT_BAD_REQUEST
    if spec["mode"] not in ("agnostic", "aware"):
        print(f"mode must be 'agnostic' or 'aware', got {spec['mode']!r}", file=sys.stderr)
        return EXIT_BAD_REQUEST
    try:
        run_trials(spec, available, Path(argv[1]))
    except Exception as error:  # one line for kvwise's error message; the traceback is no use there
        print(f"kvpress runner failed: {type(error).__name__}: {error}".replace("\n", " "), file=sys.stderr)
        return 1
    return 0


def available_presses(kvpress) -> dict[str, type]:
    """kvpress's presses that take a `compression_ratio` (wrappers such as AdaKVPress take a press)."""
    presses = {}
    for name in kvpress.__all__:
        press_class = getattr(kvpress, name)
        abstract = press_class in (kvpress.BasePress, kvpress.ScorerPress)  # they leave score() to subclasses
        if isinstance(press_class, type) and issubclass(press_class, kvpress.BasePress) and not abstract:
            if dataclasses.is_dataclass(press_class):
                if "compression_ratio" in {field.name for field in dataclasses.fields(press_class)}:
                    presses[name] = press_class
    return dict(sorted(presses.items()))


def run_trials(spec: dict, available: dict[str, type], out_path: Path) -> None:
    import torch

    if spec.get("num_threads"):
        torch.set_num_threads(int(spec["num_threads"]))
    pipelines = {}  # attention implementation -> pipeline over a model loaded with it
    cells = [(name, ratio) for name in spec["presses"] for ratio in spec["ratios"]]
    trials = spec["trials"]
    num_new_tokens = int(spec["num_new_tokens"])
    kvpress_version = version("kvpress")
    done, total = 0, len(trials) * len(cells)
    with out_path.open("a") as out:
        for trial in trials:
            for name, ratio in cells:
                attention = "eager" if name in EAGER_PRESSES else "sdpa"
                if attention not in pipelines:
                    pipelines[attention] = load_pipeline(spec["model_dir"], attention)
                    # the first forward pays one-time costs that would bias the first trial (kvwise warms up too)
                    run_trial(pipelines[attention], None, trial, spec["mode"], num_new_tokens)
                press = available[name](compression_ratio=ratio)
                measured = run_trial(pipelines[attention], press, trial, spec["mode"], num_new_tokens)
                row = {"id": trial["id"], "press": name, "ratio": ratio, "kvpress_version": kvpress_version}
                out.write(json.dumps({**row, **measured}) + "\n")
                out.flush()
                done += 1
                print(
                    f"kvpress {done}/{total}: trial {trial['id']} {name} ratio={ratio} {measured['seconds']:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )


def load_pipeline(model_dir: str, attention: str):
    """kvpress's pipeline over the checkpoint kvwise saved, in float32 on CPU."""
    import logging

    import torch
    import transformers
    from kvpress import KVPressTextGenerationPipeline

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # its carriage-return bars would be the runner's "last line"
    logging.getLogger("kvpress").setLevel(logging.ERROR)  # KVzipPress warns of its cost at every instance

    class MeasuringPipeline(KVPressTextGenerationPipeline):
        """Records what the cache holds when the question arrives: the context after compression."""

        def generate_answer(self, question_ids, cache, context_length, max_new_tokens):
            self.compressed_kv_bytes = cache_bytes(cache)
            self.masked_kv_entries = masked_entries(self.model)
            return super().generate_answer(question_ids, cache, context_length, max_new_tokens)

    # KVzipPress re-reads the tokenizer from model.config.name_or_path: load from the directory
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attention
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model.eval()
    # kvwise decodes exactly num_new_tokens; kvpress stops at EOS unless the model has none
    model.generation_config.eos_token_id = None
    return MeasuringPipeline(model=model, tokenizer=tokenizer, device="cpu")


def run_trial(pipeline, press, trial: dict, mode: str, num_new_tokens: int) -> dict:
    """One trial as kvwise's `run_trial` times it: context forward under the press to the last new token."""
    import torch
    from transformers import DynamicCache

    context_ids = torch.tensor([trial["context_ids"]])  # [1, context_len]
    question_ids = torch.tensor([trial["question_ids"]])  # [1, question_len]
    if mode == "agnostic":
        compressed_ids, rest_ids = context_ids, question_ids
    else:  # query-aware: compress the whole prompt but its last token, as kvwise does
        whole = torch.cat([context_ids, question_ids], dim=1)
        compressed_ids, rest_ids = whole[:, :-1], whole[:, -1:]
    started = time.perf_counter()
    with torch.no_grad():
        answers = pipeline._forward(  # noqa: SLF001  (kvpress's own prefill-compress-generate step, on our ids)
            {"context_ids": compressed_ids, "questions_ids": [rest_ids]},
            max_new_tokens=num_new_tokens,
            press=press,
            cache=DynamicCache(),
        )
    seconds = time.perf_counter() - started
    for layer in pipeline.model.model.layers:  # a head-wise press's mask must not outlive its trial
        layer.self_attn.masked_key_indices = None
    return {
        "kv_bytes": pipeline.compressed_kv_bytes,
        "masked_kv_entries": pipeline.masked_kv_entries,
        "compressed_tokens": compressed_ids.shape[1],
        "seconds": seconds,
        "answer": answers[0],
    }


def cache_bytes(cache) -> int:
    """Bytes of the key and value tensors the cache's layers hold."""
    tensors = [tensor for layer in cache.layers for tensor in (layer.keys, layer.values) if tensor is not None]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def masked_entries(model) -> int:
    """(head, token) keys that head-wise presses (KVzipPress, AdaKVPress) hide at attention time
    while the cache still holds them: their compression saves no memory."""
    indices = [getattr(layer.self_attn, "masked_key_indices", None) for layer in model.model.layers]
    return sum(len(index[0]) for index in indices if index is not None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
