"""The mixed workload of `kvwise bench adaptive`: four request classes arriving open-loop.

- retrieval: a needle with a random key in a 1-4K token passage, then the question (16 tokens out);
- chat: a long passage and an open question about it (64 tokens out);
- short: a short question (32 tokens out);
- long generation: a short passage and a request for a long essay (512 tokens out).

Passages are cut at random offsets of the bench text (the essays before the calibration ones, or
`--haystack-dir`), so requests share no prefix beyond the chat template's head. Every request
ignores EOS: each system produces the same number of tokens, so throughput compares like with like.
Arrivals are a Poisson process at `rate` requests per second, deterministic for a seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvwise.hf.chat_template import bos_ids, has_chat_template, render_chat
from kvwise.util.essays import read_haystack, split_essays

CLASSES = ("retrieval", "chat", "short", "long_generation")
OUTPUT_TOKENS = {"retrieval": 16, "chat": 64, "short": 32, "long_generation": 512}
CHAT_QUESTION = "\n\nWhat are the main ideas of the text above, and do you agree with them? Explain."
SHORT_QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Give me a tip for writing clear emails.",
    "What is a prime number?",
    "How do plants make food?",
    "Suggest a name for a small bakery.",
    "What does a compiler do?",
)
LONG_ASK = "Write a long, detailed essay that develops the ideas of this passage:\n\n"


@dataclass
class WorkloadRequest:
    """prompt: token ids; klass: one of CLASSES; answer: the key a retrieval request must produce;
    context_tokens: for chat, where the passage ends (the reference continuation is scored after it)."""

    index: int
    klass: str
    prompt: list[int]
    max_tokens: int
    arrival: float  # seconds after the run starts (or after the request it follows finishes)
    answer: str | None = None
    follows: int | None = None  # the index of the request whose finish sends this one (a closed loop)
    document_end: int | None = None  # where a document the request asks about ends (`compress_upto`)


@dataclass
class WorkloadSpec:
    requests: int = 120
    proportions: tuple[float, float, float, float] = (0.4, 0.3, 0.2, 0.1)  # retrieval, chat, short, long
    retrieval_tokens: tuple[int, int] = (1000, 4000)
    chat_tokens: tuple[int, int] = (1000, 3000)
    long_prompt_tokens: tuple[int, int] = (200, 500)
    long_output_tokens: int = OUTPUT_TOKENS["long_generation"]
    seed: int = 0
    haystack_dir: str | None = None
    needle: str = "\nThe special magic number is {key}.\n"
    question: str = "\n\nWhat is the special magic number mentioned in the text above?"
    answer_prefix: str = "The special magic number is"

    def __post_init__(self):
        if len(self.proportions) != len(CLASSES) or any(p < 0 for p in self.proportions) or not sum(self.proportions):
            raise ValueError("--mix takes four non-negative proportions: retrieval, chat, short, long generation")
        if self.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {self.requests}")
        if "{key}" not in self.needle:
            raise ValueError("the needle template must contain {key}")

    def build(self, tokenizer) -> list[WorkloadRequest]:
        return build_workload(tokenizer, self)


def build_workload(tokenizer, spec: WorkloadSpec) -> list[WorkloadRequest]:
    """The requests in arrival order, with arrivals at rate 1 (scale them with `at_rate`)."""
    text = read_haystack(spec.haystack_dir) if spec.haystack_dir else split_essays()[0]
    stream = tokenizer(text, add_special_tokens=False).input_ids
    rng = random.Random(spec.seed)
    if len(stream) < spec.retrieval_tokens[1] + 100:
        raise ValueError(f"the haystack holds {len(stream)} tokens; retrieval passages need {spec.retrieval_tokens[1]}")
    chat = has_chat_template(tokenizer)
    total = sum(spec.proportions)
    counts = [round(spec.requests * share / total) for share in spec.proportions]
    counts[0] += spec.requests - sum(counts)  # rounding goes to retrieval
    kinds = [klass for klass, count in zip(CLASSES, counts) for _ in range(count)]
    rng.shuffle(kinds)

    def passage(bounds: tuple[int, int]) -> str:
        length = rng.randint(*bounds)
        start = rng.randint(0, len(stream) - length)
        return tokenizer.decode(stream[start : start + length])

    def encode(user_text: str, answer_prefix: str = "") -> list[int]:
        if chat:
            return tokenizer(
                render_chat(tokenizer, [{"role": "user", "content": user_text}]) + answer_prefix,
                add_special_tokens=False,
            ).input_ids
        tail = "\n" + answer_prefix if answer_prefix else "\n"
        return bos_ids(tokenizer) + tokenizer(user_text + tail, add_special_tokens=False).input_ids

    requests, clock = [], 0.0
    for index, klass in enumerate(kinds):
        clock += rng.expovariate(1.0)
        answer = None
        if klass == "retrieval":
            body = passage(spec.retrieval_tokens)
            answer = str(rng.randint(10000, 99999))
            cut = rng.randint(0, len(body))
            prompt = encode(
                body[:cut] + spec.needle.format(key=answer) + body[cut:] + spec.question, spec.answer_prefix
            )
        elif klass == "chat":
            prompt = encode(passage(spec.chat_tokens) + CHAT_QUESTION)
        elif klass == "short":
            prompt = encode(rng.choice(SHORT_QUESTIONS))
        else:
            prompt = encode(LONG_ASK + passage(spec.long_prompt_tokens))
        out = spec.long_output_tokens if klass == "long_generation" else OUTPUT_TOKENS[klass]
        requests.append(WorkloadRequest(index, klass, prompt, out, clock, answer))
    return requests


def at_rate(requests: list[WorkloadRequest], rate: float | None) -> list[float]:
    """Arrival times in seconds for `rate` requests per second (None: all at once, a burst)."""
    if rate is None:
        return [0.0] * len(requests)
    if rate <= 0:
        raise ValueError(f"--rate must be positive, got {rate}")
    return [request.arrival / rate for request in requests]
