"""Which class a request belongs to, for the controller: from a hint, or from its features.

Hints (`kv_profile`): retrieval, chat, long_generation, or auto. Without one (or with auto):
- a long expected output (max_tokens >= LONG_OUTPUT_TOKENS) is a long generation;
- a document compressed once (`compress_upto`) or a long prompt with a short answer is retrieval;
- the rest (several turns, open-ended replies) is chat.
"""

from __future__ import annotations

from kvwise.adaptive.profile import CLASSES

HINTS = (*CLASSES, "auto")
LONG_OUTPUT_TOKENS = 256  # max_tokens at or above this: a long generation
SHORT_ANSWER_TOKENS = 32  # max_tokens at or below this after a long prompt: a retrieval question
LONG_PROMPT_TOKENS = 1024


class UnknownHint(ValueError):
    """A class hint the controller does not know; `param` names the API field it came in."""

    param = "kv_profile"


def check_hint(hint: str | None) -> str | None:
    """The one check of a class hint, where a request enters the engine (`EngineCore.make_request`)."""
    if hint is not None and hint not in HINTS:
        raise UnknownHint(f"unknown kv_profile {hint!r}; choose from: {', '.join(HINTS)}")
    return hint


def classify(prompt_tokens: int, max_tokens: int, hint: str | None = None, compresses_document=False, turns=0) -> str:
    """The request class: the hint (checked when the request was made) when it names one, else
    the features' rule above."""
    if hint not in (None, "auto"):
        return hint
    if max_tokens >= LONG_OUTPUT_TOKENS:
        return "long_generation"
    if compresses_document:
        return "retrieval"
    if turns <= 1 and prompt_tokens >= LONG_PROMPT_TOKENS and max_tokens <= SHORT_ANSWER_TOKENS:
        return "retrieval"
    return "chat"
