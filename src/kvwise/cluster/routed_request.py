"""What the ingress sends a replica: the HTTP request as it came, plus what routing needs.

`blocks` are the short names (`prefix_directory.short_key`) of the prompt's chained block keys,
computed with the replicas' own hashing: same tokenizer and chat template, the caller's tenant,
its shared segment, the weights fingerprint, the KV format and the namespace secret. `prompt` or
`messages` carry the text for text-based routers (as Ray Serve LLM's routers read them).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from starlette.requests import Request

from kvwise.cluster.prefix_directory import short_key
from kvwise.core.hashing import Namespace, chain_keys
from kvwise.engine.core import EngineCore


@dataclass
class RoutedRequest:
    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    blocks: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    prompt: str | None = None  # completions: the prompt text
    messages: list | None = None  # chat: the messages
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    avoid: list[str] = field(default_factory=list)  # replicas that already failed this request
    target: str | None = None  # control calls (metrics) to one named replica


@dataclass(frozen=True)
class KeySpace:
    """What names a replica's blocks, besides the tokens (every replica reports the same)."""

    model_id: str
    kv_format: str
    block_size: int


class PromptEncoder:
    """What the server's request handling needs of an engine to tokenize: `EngineCore.encode`
    itself, over the same tokenizer and vocabulary size, without the model."""

    encode = EngineCore.encode

    def __init__(self, tokenizer, vocab_size: int, max_positions: int | None):
        self.tokenizer, self.vocab_size, self.max_positions = tokenizer, vocab_size, max_positions


class RoutingKeys:
    """Block names of a request, from the server's own request handling (`server.app`): the
    same parsing, tenant and shared-segment rules, chat template and tokenizer. Whatever the
    server would refuse gets no names: the replica it lands on answers with the error."""

    def __init__(self, handlers, key_space: KeySpace, secret: bytes):
        self.handlers, self.key_space, self.secret = handlers, key_space, secret

    def annotate(self, routed: RoutedRequest) -> RoutedRequest:
        try:
            self._annotate(routed)
        except Exception:  # any refusal: routed without prefix names; the replica explains it
            routed.blocks, routed.prompt_tokens = [], 0
        return routed

    def _annotate(self, routed: RoutedRequest) -> None:
        from kvwise.server.protocol import ChatRequest, CompletionRequest

        chat = routed.path.rstrip("/").endswith("/chat/completions")
        if not chat and not routed.path.rstrip("/").endswith("/completions"):
            return
        data = json.loads(routed.body)
        body = (ChatRequest if chat else CompletionRequest).model_validate(data)
        scope = {"type": "http", "method": routed.method, "path": routed.path, "headers": routed.headers}
        caller = self.handlers.caller(Request(scope))
        if chat:
            routed.messages = data.get("messages")
            prompts = self.handlers.chat_prompts(body)
        else:
            routed.prompt = body.prompt if isinstance(body.prompt, str) else json.dumps(body.prompt)
            prompts = self.handlers.completion_prompts(body)
        tokens = prompts[0]
        shared = self.handlers.shared_tokens(body, caller, chat, prompts)
        space = self.key_space
        namespace = Namespace(space.model_id, caller.tenant, space.kv_format, self.secret)
        namespace = namespace.with_shared_prefix(shared // space.block_size)
        usable = (len(tokens) - 1) // space.block_size  # the engine computes the last token itself
        keys = chain_keys(tokens[: usable * space.block_size], space.block_size, namespace)
        routed.blocks = [short_key(key) for key in keys]
        routed.prompt_tokens = len(tokens)
