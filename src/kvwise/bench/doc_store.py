"""The doc-store workload of `kvwise bench adaptive --workload doc-store`: questions over a store of
documents, most of them about a few popular ones.

Each document is a disjoint slice of the bench text (or `haystack_dir`) with one key sentence
inserted at a random place ("The access code for the <name> file is <5 digits>.", or the
spec's `key_sentence`). Each request asks for one
document's code: its prompt is the document (`compress_upto` ends there, so a system may compress
it once, query-agnostically, and reuse it), then a question whose wording varies, then the start
of the answer. Documents are drawn with Zipf popularity, so a few are asked about again and again
and most only once or twice. An answer is right when the code is in it.

Closed loop: `clients` users each send their next request when their last one is answered, so
time to first token measures what the store costs, not how fast requests arrive. Every answer
ignores EOS: each system produces the same number of tokens.

The budget is a fraction of the full KV of the documents asked about (`document_bytes`), over the
pool and a host tier together: every system in this workload gets the same tiers (`tier_layout`),
and the pool keeps room for the requests running at once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvwise.bench.adaptive_workload import WorkloadRequest
from kvwise.hf.chat_template import bos_ids, has_chat_template, render_chat
from kvwise.util.essays import read_haystack, split_essays

CLASS = "doc_store"
NAMES = (
    "amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper",
    "kestrel", "lantern", "meadow", "nimbus", "orchid", "pewter", "quartz", "raven", "saffron", "tundra",
    "umber", "violet", "willow", "xenon", "yarrow", "zephyr", "alder", "birch", "cobalt", "dune",
    "egret", "flint", "glacier", "heron", "iris", "jasper", "kelp", "lichen", "maple", "nectar",
)  # fmt: skip
KEY_SENTENCE = "\nThe access code for the {name} file is {key}.\n"
QUESTIONS = (
    "What is the access code for the {name} file?",
    "Which access code does the text give for the {name} file?",
    "Find the access code of the {name} file in the text above.",
    "I need the {name} file's access code. What is it?",
)
ANSWER_PREFIX = "The access code for the {name} file is"
ANSWER_TOKENS = 12


@dataclass
class DocStoreSpec:
    documents: int = 32
    document_tokens: tuple[int, int] = (1800, 2200)
    requests: int = 96
    clients: int = 2  # users asking at once, each waiting for its answer (a closed loop)
    zipf_exponent: float = 1.1
    seed: int = 0
    haystack_dir: str | None = None
    tier_layout: str = "host"  # every system's KV beyond the pool goes to a host tier, within the budget
    # a held-out run brings its own: the key sentence ({name}, {key}), a question and the answer's start ({name})
    key_sentence: str = KEY_SENTENCE
    question: str | None = None  # None: one of QUESTIONS, drawn per request
    answer_prefix: str = ANSWER_PREFIX

    def __post_init__(self):
        if not 2 <= self.documents <= len(NAMES):
            raise ValueError(f"doc-store takes 2 to {len(NAMES)} documents, got {self.documents}")
        if not 64 <= self.document_tokens[0] <= self.document_tokens[1]:
            raise ValueError(f"document tokens must be >= 64 and increasing, got {self.document_tokens}")
        if self.requests < 2 or not 1 <= self.clients <= self.requests:
            raise ValueError(
                f"doc-store needs >= 2 requests and 1 to `requests` clients, got {self.requests} and {self.clients}"
            )
        if self.zipf_exponent < 0:
            raise ValueError(f"the Zipf exponent must be >= 0, got {self.zipf_exponent}")
        if "{name}" not in self.key_sentence or "{key}" not in self.key_sentence:
            raise ValueError("the doc-store key sentence must contain {name} and {key}")
        if self.question is not None and "{name}" not in self.question:
            raise ValueError("the doc-store question must contain {name}")
        if self.tier_layout not in ("host",):
            raise ValueError(f"unknown tier layout {self.tier_layout!r}; doc-store has: host")

    def build(self, tokenizer) -> list[WorkloadRequest]:
        return build_doc_store(tokenizer, self)


@dataclass
class Document:
    name: str
    code: str
    ids: list[int]  # the document's tokens, key sentence included


def build_doc_store(tokenizer, spec: DocStoreSpec) -> list[WorkloadRequest]:
    """The requests in order; the first `clients` arrive at once, each later one follows the
    request `clients` before it. `WorkloadRequest.document_end` marks where its document ends."""
    text = read_haystack(spec.haystack_dir) if spec.haystack_dir else split_essays()[0]
    stream = tokenizer(text, add_special_tokens=False).input_ids
    rng = random.Random(spec.seed)
    lengths = [rng.randint(*spec.document_tokens) for _ in range(spec.documents)]
    if sum(lengths) > len(stream):
        raise ValueError(
            f"the haystack holds {len(stream)} tokens; {spec.documents} disjoint documents need {sum(lengths)}"
        )
    names = rng.sample(NAMES, spec.documents)
    documents, cursor = [], rng.randint(0, len(stream) - sum(lengths))
    for name, length in zip(names, lengths):
        body = tokenizer.decode(stream[cursor : cursor + length])
        cursor += length
        code = str(rng.randint(10000, 99999))
        cut = rng.randint(0, len(body))
        with_key = body[:cut] + spec.key_sentence.format(name=name, key=code) + body[cut:]
        documents.append(Document(name, code, tokenizer(with_key, add_special_tokens=False).input_ids))
    head, tail = _frame(tokenizer)
    weights = [1.0 / (rank + 1) ** spec.zipf_exponent for rank in range(spec.documents)]
    requests = []
    for index in range(spec.requests):
        document = rng.choices(documents, weights)[0]
        question = "\n\n" + (spec.question or rng.choice(QUESTIONS)).format(name=document.name)
        after = tokenizer(question + tail + spec.answer_prefix.format(name=document.name), add_special_tokens=False)
        prompt = head + document.ids + after.input_ids
        follows = index - spec.clients if index >= spec.clients else None
        requests.append(
            WorkloadRequest(
                index,
                CLASS,
                prompt,
                ANSWER_TOKENS,
                0.0,
                answer=document.code,
                follows=follows,
                document_end=len(head) + len(document.ids),
            )
        )
    return requests


def _frame(tokenizer) -> tuple[list[int], str]:
    """The ids before a user message's text, and the text after it (up to the reply's start)."""
    if not has_chat_template(tokenizer):
        return bos_ids(tokenizer), "\n"
    marker = "\x00DOCUMENT\x00"
    rendered = render_chat(tokenizer, [{"role": "user", "content": marker}])
    before, after = rendered.split(marker)
    return tokenizer(before, add_special_tokens=False).input_ids, after


def document_bytes(requests: list[WorkloadRequest], token_bytes: int) -> int:
    """Every distinct document's full KV (the shared head before it included), in bytes."""
    ends = {tuple(r.prompt[: r.document_end]) for r in requests if r.document_end is not None}
    return sum(len(tokens) for tokens in ends) * token_bytes
