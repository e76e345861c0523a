"""NIAH data: the needle placement of ../docs BENCHMARKS (the essays themselves: `util.essays`)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kvwise.hf.chat_template import bos_ids, has_chat_template, render_chat
from kvwise.util.essays import default_haystack_dir, read_haystack, split_essays

__all__ = ["default_haystack_dir", "read_haystack", "split_essays", "NeedlePromptBuilder", "trial_grid"]

DEFAULT_NEEDLE = "\nThe special magic number is {key}.\n"
DEFAULT_QUESTION = "\n\nWhat is the special magic number mentioned in the text above?"
DEFAULT_ANSWER_PREFIX = "The special magic number is"


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
