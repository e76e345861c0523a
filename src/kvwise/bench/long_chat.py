"""The long-chat workload of `kvwise bench adaptive --workload long-chat`: conversations whose
history grows turn by turn until KV memory binds.

Each conversation opens with a passage the user pastes and a question about it; each later turn
adds the assistant's earlier reply and another passage with a question. The earlier replies in
the history are the same fixed text for every system (an excerpt of the bench text, as a replayed
chat log would hold), so every system is sent the same prompts; the reply a system generates is
scored, not appended. A turn's prompt is its previous turn's prompt plus the new messages, token
for token, so prefix caching can serve the history while it is held.

Closed loop: every conversation starts at once, and its next turn is sent when its previous turn
finishes (`WorkloadRequest.follows`). Every reply ignores EOS, so each system produces the same
number of tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvwise.bench.adaptive_workload import WorkloadRequest
from kvwise.hf.chat_template import bos_ids, has_chat_template, render_chat
from kvwise.util.essays import read_haystack, split_essays

CLASS = "long_chat"
QUESTIONS = (
    "What does this add to what we discussed? Answer in detail.",
    "Summarize the argument so far, then say where you disagree.",
    "Which idea here matters most, and why? Give examples.",
    "How would you explain all of this to a new student?",
)
HISTORY_REPLY_TOKENS = 120  # each earlier assistant reply in the history


@dataclass
class LongChatSpec:
    conversations: int = 8
    turns: int = 4
    history_tokens: tuple[int, int] = (4000, 7000)  # where a conversation's last prompt ends
    reply_tokens: tuple[int, int] = (128, 256)
    seed: int = 0
    haystack_dir: str | None = None

    def __post_init__(self):
        if self.conversations < 1 or self.turns < 1:
            raise ValueError(f"long-chat needs >= 1 conversation and turn, got {self.conversations} and {self.turns}")
        low, high = self.history_tokens
        if not 0 < low <= high or low < 64 * self.turns:
            raise ValueError(f"history tokens must be increasing and >= 64 per turn, got {self.history_tokens}")
        if not 0 < self.reply_tokens[0] <= self.reply_tokens[1]:
            raise ValueError(f"reply tokens must be positive and increasing, got {self.reply_tokens}")

    @property
    def requests(self) -> int:
        return self.conversations * self.turns

    def build(self, tokenizer) -> list[WorkloadRequest]:
        return build_long_chat(tokenizer, self)


def build_long_chat(tokenizer, spec: LongChatSpec) -> list[WorkloadRequest]:
    """Every turn of every conversation; a conversation's first turn arrives at 0, each later one
    follows the turn before it."""
    text = read_haystack(spec.haystack_dir) if spec.haystack_dir else split_essays()[0]
    stream = tokenizer(text, add_special_tokens=False).input_ids
    rng = random.Random(spec.seed)
    if len(stream) < spec.history_tokens[1]:
        raise ValueError(f"the haystack holds {len(stream)} tokens; a conversation needs {spec.history_tokens[1]}")
    chat = has_chat_template(tokenizer)

    def excerpt(length: int) -> str:
        start = rng.randint(0, len(stream) - length)
        return tokenizer.decode(stream[start : start + length])

    def render(messages: list[dict]) -> str:
        if chat:
            return render_chat(tokenizer, messages)
        lines = [f"{message['role'].capitalize()}: {message['content']}" for message in messages]
        return "\n\n".join(lines) + "\n\nAssistant:"

    requests: list[WorkloadRequest] = []
    for _ in range(spec.conversations):
        final = rng.randint(*spec.history_tokens)
        # each turn adds about the same: a passage, a question and (after the first) a reply
        passage = max(16, final // spec.turns - HISTORY_REPLY_TOKENS)
        messages: list[dict] = []
        rendered, ids = "", [] if chat else bos_ids(tokenizer)
        previous = None
        for turn in range(spec.turns):
            if turn:
                messages.append({"role": "assistant", "content": excerpt(HISTORY_REPLY_TOKENS)})
            messages.append({"role": "user", "content": excerpt(passage) + "\n\n" + rng.choice(QUESTIONS)})
            text = render(messages)
            if not text.startswith(rendered):
                raise ValueError("the chat template does not render a conversation as an extension of its start")
            ids = ids + tokenizer(text[len(rendered) :], add_special_tokens=False).input_ids
            rendered = text
            index = len(requests)
            requests.append(
                WorkloadRequest(index, CLASS, list(ids), rng.randint(*spec.reply_tokens), 0.0, follows=previous)
            )
            previous = index
    return requests
