"""Request bodies of the OpenAI API, as pydantic models, and the error type the server answers with.

Unknown fields are refused (a typo should not silently change nothing). Types and shapes are
checked here (422); values are checked where they are used, by SamplingParams and the engine
(400), so the rules live in one place for the offline API and the server alike.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        408: "invalid_request_error",
        413: "invalid_request_error",
        422: "invalid_request_error",
        403: "permission_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class KVPrefix(_Strict):
    """A leading segment of the request: the first `messages` chat messages, or the first `tokens`
    prompt tokens. `shared: true` looks it up in, and publishes it to, the shared namespace (a
    system prompt every tenant sends); the rest of the request stays private. `compress: MIX`
    (e.g. "kvzip@0.9+kivi4") compresses the segment, a document, once and without the question
    after it; later requests with the same segment and mix reuse it and compute only their
    question."""

    messages: int | None = Field(default=None, ge=1)
    tokens: int | None = Field(default=None, ge=1)
    shared: bool = False
    compress: str | None = Field(default=None, max_length=512)


class KVOptions(_Strict):
    """kvwise's per-request KV settings (send them with the OpenAI client's `extra_body`)."""

    kv_prefix: KVPrefix | None = None

    kv_policy: str | None = None
    kv_ratio: float | None = None
    kv_quant: str | None = None
    max_kv_tokens: int | None = None
    # all of the above in one mix spec, e.g. "kvzip@0.9+kivi4" or "h2o@max=1024" (kvwise.policies.mix)
    kv_mix: str | None = Field(default=None, max_length=512)
    # with `serve --kv-policy auto`: the request's class for the controller (retrieval, chat,
    # long_generation, or auto: from its features); explicit settings above win over it
    kv_profile: str | None = Field(default=None, max_length=64)


class ResponseFormat(BaseModel):
    """Only `text` is served (and ignored: it is the default); a JSON format is refused by name."""

    model_config = ConfigDict(extra="allow")  # json_schema carries its schema
    type: Literal["text", "json_object", "json_schema"]


# Fields common clients send that do not change the answer: accepted, ignored, and named in the
# response's Warning header. Fields that would change it, which kvwise does not do: a 400 naming them.
IGNORED_FIELDS = ("metadata", "store", "service_tier", "parallel_tool_calls", "response_format")
UNSUPPORTED_FIELDS = ("tools", "functions", "tool_choice", "function_call", "logit_bias")


class _Sampling(KVOptions):
    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension, as in vLLM
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False  # extension, as in vLLM
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # extension, as in vLLM
    min_p: float = 0.0  # extension, as in vLLM
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)  # extension, as in vLLM
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = Field(default=None, max_length=64)
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    tools: list | None = None
    functions: list | None = None
    tool_choice: str | dict | None = None
    function_call: str | dict | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # 0 with echo: score the prompt, generate nothing
    logprobs: int | None = None
    echo: bool = False  # the prompt comes back before the text; with logprobs, its tokens' too
    prompt_logprobs: int | None = None  # extension, as in vLLM: the prompt tokens' logprobs by token id


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
