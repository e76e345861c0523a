"""Calibration probes: short tasks cut from calibration text, one kind per request class.

- retrieval: a needle sentence with a random key hidden in a 1-2K token passage, then a question;
  the answer is right when the key appears in the greedy reply;
- chat (continuation): a passage, scored by the perplexity of the text that really follows it and by
  the agreement of 32 greedy tokens with the full cache's;
- long_generation: a short passage and 32 greedy tokens, scored by agreement.

The text is the built-in calibration essays (disjoint from every essay a bench scores on) or the
user's own documents (`--data DIR`: every .txt and .md file). The needle differs from the benches'.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from kvwise.hf.chat_template import bos_ids, has_chat_template, render_chat
from kvwise.util.essays import split_essays

NEEDLE = "\nThe access code for the archive is {key}.\n"
QUESTION = "\n\nWhat is the access code for the archive mentioned in the text above?"
ANSWER_PREFIX = "The access code for the archive is"
CONTINUATION_TOKENS = 64  # scored by perplexity after a chat probe's context
AGREEMENT_TOKENS = 32  # greedy tokens compared with the full cache's


@dataclass
class Probe:
    """prompt_ids: [1, n] what is compressed and answered (retrieval: all but the last token is
    compressed, as the engine does at the end of a prompt); continuation_ids: [1, m] the text after
    a chat probe's prompt (None for other kinds); answer: the key a retrieval probe must produce."""

    klass: str
    prompt_ids: torch.Tensor
    continuation_ids: torch.Tensor | None = None
    answer: str | None = None


def calibration_text(data_dir: str | Path | None = None) -> tuple[str, str]:
    """(text, description): the user's documents, or the built-in calibration essays."""
    if data_dir is None:
        return split_essays()[1], "built-in calibration essays"
    folder = Path(data_dir)
    if not folder.is_dir():
        raise ValueError(f"--data {folder}: not a directory")
    files = sorted([*folder.rglob("*.txt"), *folder.rglob("*.md")])
    if not files:
        raise ValueError(f"--data {folder}: no .txt or .md files in it")
    text = "\n\n".join(path.read_text(encoding="utf-8", errors="replace") for path in files)
    return text, f"{len(files)} documents under {folder}"


LENGTHS = {"retrieval": (1000, 2000), "chat": (600, 1200), "long_generation": (256, 512)}  # passage tokens


def make_probes(
    tokenizer, text: str, counts: dict[str, int], seed: int = 0, lengths: dict | None = None
) -> list[Probe]:
    """`counts[klass]` probes of each class, deterministic for `seed`, from one token stream of
    `text`, with passages of `lengths[klass]` = (fewest, most) tokens (default LENGTHS)."""
    lengths = {**LENGTHS, **(lengths or {})}
    stream = tokenizer(text, add_special_tokens=False).input_ids
    rng = random.Random(seed)
    needed = {klass: most + (CONTINUATION_TOKENS if klass == "chat" else 0) for klass, (_, most) in lengths.items()}
    longest = max((needed[klass] for klass, count in counts.items() if count), default=0)
    if len(stream) < longest + 1:
        raise ValueError(f"the calibration text holds {len(stream)} tokens; probes need at least {longest + 1}")

    def passage(length: int) -> list[int]:
        start = rng.randint(0, len(stream) - length)
        return stream[start : start + length]

    probes = []
    for _ in range(counts.get("retrieval", 0)):
        probes.append(_retrieval(tokenizer, passage(rng.randint(*lengths["retrieval"])), rng))
    for _ in range(counts.get("chat", 0)):
        ids = passage(rng.randint(*lengths["chat"]) + CONTINUATION_TOKENS)
        context, continuation = ids[:-CONTINUATION_TOKENS], ids[-CONTINUATION_TOKENS:]
        probes.append(Probe("chat", torch.tensor([bos_ids(tokenizer) + context]), torch.tensor([continuation])))
    for _ in range(counts.get("long_generation", 0)):
        probes.append(
            Probe(
                "long_generation",
                torch.tensor([_instruction(tokenizer, passage(rng.randint(*lengths["long_generation"])))]),
            )
        )
    return probes


def _retrieval(tokenizer, passage: list[int], rng: random.Random) -> Probe:
    key = str(rng.randint(10000, 99999))
    split = rng.randint(0, len(passage))
    context = tokenizer.decode(passage[:split]) + NEEDLE.format(key=key) + tokenizer.decode(passage[split:])
    if has_chat_template(tokenizer):
        text = render_chat(tokenizer, [{"role": "user", "content": context + QUESTION}]) + ANSWER_PREFIX
        ids = tokenizer(text, add_special_tokens=False).input_ids
    else:
        ids = (
            bos_ids(tokenizer)
            + tokenizer(context + QUESTION + "\n" + ANSWER_PREFIX, add_special_tokens=False).input_ids
        )
    return Probe("retrieval", torch.tensor([ids]), answer=key)


def _instruction(tokenizer, passage: list[int]) -> list[int]:
    """A request for a long answer about a passage (through the chat template when there is one)."""
    ask = "Write a long, detailed essay that continues the ideas of this text:\n\n" + tokenizer.decode(passage)
    if has_chat_template(tokenizer):
        return tokenizer(render_chat(tokenizer, [{"role": "user", "content": ask}]), add_special_tokens=False).input_ids
    return bos_ids(tokenizer) + tokenizer(ask, add_special_tokens=False).input_ids


def agreement(tokens: list[int], reference: list[int]) -> float:
    """1 when the first AGREEMENT_TOKENS tokens equal the reference's, else the fraction of those
    positions that match."""
    compared = reference[:AGREEMENT_TOKENS]
    return sum(a == b for a, b in zip(tokens, compared)) / max(1, len(compared))
