"""The FastAPI application: OpenAI's /v1/models, /v1/completions and /v1/chat/completions
(streaming and not), /health and /metrics, with API keys mapped to tenants.

Every error is OpenAI-shaped JSON: 400 bad values, 401 a missing or unknown key, 404 an unknown
model or route, 413 a body or prompt too large, 422 malformed JSON or a wrong field, 429 a full
queue (with Retry-After), 503 while shutting down.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvwise.engine.core import ContextLengthError, EngineCore
from kvwise.engine.detokenizer import IncrementalText
from kvwise.engine.kv_settings import resolve
from kvwise.engine.sampling import SamplingParams
from kvwise.hf.chat_template import NO_TEMPLATE_SERVER_HINT, has_chat_template, render_chat
from kvwise.policies.mix import Mix
from kvwise.server.api_keys import KeyEntry, find_key
from kvwise.server.async_engine import AsyncEngine, EngineFailure
from kvwise.server.kv_fields import (
    compression_settings,
    default_kv_quant_options,
    kv_auto,
    kv_usage,
    request_kv_settings,
)
from kvwise.server.metrics import ServerMetrics
from kvwise.server.openai_format import Echo, Formatter
from kvwise.server.openapi import install_openapi, request_body
from kvwise.server.protocol import (
    IGNORED_FIELDS,
    UNSUPPORTED_FIELDS,
    ChatRequest,
    CompletionRequest,
    OpenAIError,
)
from kvwise.server.stats_log import StatsLog

SHARED_PREFIX_HEADER = "x-kvwise-shared-prefix"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer (never sent)


@dataclass
class ServerSettings:
    model_name: str
    api_keys: dict[str, KeyEntry] | None = None  # None: no authentication, one tenant
    max_queue: int = 256
    max_body_bytes: int = 8 * 1024 * 1024
    default_max_tokens: int = 256  # chat requests without max_tokens
    chat_template: str | None = None  # Jinja text from --chat-template; None: the tokenizer's own
    # canonical quantizer specs requests may ask for (--kv-quant-options); each gets one pool
    kv_quant_options: frozenset[str] = field(default_factory=lambda: default_kv_quant_options())
    metrics_key: str | None = None  # --metrics-key: another key that may scrape /metrics
    metrics_per_tenant: bool = False  # label prefix-cache counters by tenant
    metrics_max_tenants: int = 32  # tenants with a label of their own; the rest are "other"
    fair_queue: bool = True  # each active tenant holds at most an equal share of the queue
    body_timeout_seconds: float = 30.0  # the longest pause while a client sends its body
    shared_timing_pad: bool = False  # hold a shared hit's first token as long as a miss would take
    default_kv_quant: str | None = None  # --kv-cache-dtype: requests without KV settings store with it
    log_stats_interval: float = 0.0  # seconds between the engine's stats lines (0: none)
    log_requests: bool = False  # a line per finished request: ids, lengths, timings, outcome
    log_request_text: bool = False  # with the prompt's and output's text in it

    @property
    def metrics_keys(self) -> list[str]:
        admins = [key for key, entry in (self.api_keys or {}).items() if entry.admin]
        return admins + ([self.metrics_key] if self.metrics_key else [])

    disconnect_poll_seconds: float = 0.25


@dataclass
class Caller:
    tenant: str
    shared_prefix: bool  # asked for the shared namespace (header, or the key's `shared` default)
    may_read_shared: bool = True
    may_write_shared: bool = True


def bearer_key(request: Request) -> str | None:
    """The key of an `Authorization: Bearer KEY` header, or None."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


async def read_body(http: Request, max_bytes: int, timeout_seconds: float) -> bytes:
    """The request body, refused with 413 past `max_bytes` and 408 when it pauses longer than
    `timeout_seconds`; counted as it arrives (a chunked body has no Content-Length)."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise OpenAIError(413, f"the request body is over {max_bytes} bytes")
    chunks, size = [], 0
    stream = http.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), timeout_seconds)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise OpenAIError(408, "the request body stopped arriving", code="body_timeout") from None
        size += len(chunk)
        if size > max_bytes:
            raise OpenAIError(413, f"the request body is over {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def check_json_values(data, max_depth: int = 64) -> None:
    """Refuse bodies that nest deeper than `max_depth` or hold strings with lone UTF-16
    surrogates (valid JSON escapes, but no tokenizer can encode them), before any handler sees them."""
    stack = [(data, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if depth > max_depth:
            raise OpenAIError(400, f"the body nests deeper than {max_depth} levels", code="malformed_json")
        if isinstance(value, str):
            where = where.encode("utf-8", "backslashreplace").decode("utf-8")  # the message must be text
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise OpenAIError(
                    400, f"{where or 'the body'} holds a lone UTF-16 surrogate, which is not text", param=where or None
                ) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str):
                    stack.append((key, depth, where))
                stack.append((item, depth + 1, f"{where}.{key}" if where else str(key)))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, f"{where}[{index}]") for index, item in enumerate(value))


def create_app(core: EngineCore, settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics(core, settings.metrics_per_tenant, settings.metrics_max_tenants, settings.model_name)
    tenants = len({entry.tenant for entry in (settings.api_keys or {}).values()}) or 1
    engine = AsyncEngine(
        core,
        settings.max_queue,
        metrics,
        fair=settings.fair_queue,
        shared_timing_pad=settings.shared_timing_pad,
        tenants=tenants,
        stats_log=StatsLog(core, settings.log_stats_interval, settings.log_requests, settings.log_request_text),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.drain()  # uvicorn has stopped accepting; let what runs finish

    app = FastAPI(title="kvwise", lifespan=lifespan)
    app.state.engine, app.state.settings = engine, settings
    handlers = RequestHandlers(core, engine, settings)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        message = f"no route {request.method} {request.url.path}" if error.status_code in (404, 405) else error.detail
        return JSONResponse(OpenAIError(error.status_code, str(message)).body(), status_code=error.status_code)

    @app.get("/health/live")
    async def live():
        """The process answers and its engine thread runs (restart it otherwise)."""
        if not engine.alive:
            raise OpenAIError(503, "the engine thread has stopped; see the server log", code="engine_down")
        return {"status": "live"}

    @app.get("/health/ready")
    async def ready():
        """New requests are taken: the engine runs and the server is not draining."""
        if not engine.started:
            raise OpenAIError(503, "the engine is starting", code="starting")
        return await health()

    @app.get("/health")
    async def health():
        if not engine.accepting:
            raise OpenAIError(503, "the server is shutting down", code="shutting_down")
        if not engine.alive:
            raise OpenAIError(503, "the engine thread has stopped; see the server log", code="engine_down")
        return {"status": "ok", "running": len(core.scheduler.running), "waiting": engine.queue_depth}

    @app.get("/metrics")
    async def metrics(request: Request):
        handlers.check_metrics_access(request)
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        handlers.caller(request)
        card = {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "kvwise"}
        card["max_model_len"] = core.max_positions
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request):
        return await handlers.run(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatRequest))
    async def chat_completions(request: Request):
        return await handlers.run(request, chat=True)

    install_openapi(app)
    return app


class RequestHandlers:
    """One API call from HTTP to engine requests and back: the caller's tenant, parsing, prompts,
    sampling and KV settings, then the response. The cluster's front door uses the same parsing
    and tenant rules (with no engine) to name a request's blocks before routing it."""

    def __init__(self, core: EngineCore, engine: AsyncEngine, settings: ServerSettings):
        self.core, self.engine, self.settings = core, engine, settings

    # ---- who is calling ------------------------------------------------------------------------
    def caller(self, request: Request) -> Caller:
        header = request.headers.get(SHARED_PREFIX_HEADER, "").strip().lower()
        if header not in ("", "true", "false", "1", "0", "yes", "no"):
            raise OpenAIError(400, f"X-KVWise-Shared-Prefix must be true or false, got {header!r}")
        shared = header in ("true", "1", "yes")
        if self.settings.api_keys is None:
            return Caller("default", shared)
        key = bearer_key(request)
        if key is None:
            raise OpenAIError(401, "missing API key: send `Authorization: Bearer KEY`", code="invalid_api_key")
        entry = find_key(self.settings.api_keys, key)
        if entry is None:
            raise OpenAIError(401, "invalid API key", code="invalid_api_key")
        return Caller(
            entry.tenant, shared or (entry.shared_prefix and header == ""), entry.shared_read, entry.shared_write
        )

    def check_metrics_access(self, request: Request) -> None:
        """With API keys, /metrics needs an admin key (or --metrics-key): it describes every tenant's load."""
        allowed = self.settings.metrics_keys
        if self.settings.api_keys is None and not allowed:
            return
        key = bearer_key(request)
        if key is None:
            message = "/metrics needs an admin key: send `Authorization: Bearer KEY`"
            raise OpenAIError(401, message, code="invalid_api_key")
        if not any(hmac.compare_digest(key.encode(), admin.encode()) for admin in allowed):
            raise OpenAIError(403, "this key may not read /metrics (it needs `admin` in the key file)")

    # ---- one API call --------------------------------------------------------------------------
    async def run(self, http: Request, chat: bool) -> Response:
        caller = self.caller(http)
        body = await self._parse(http, ChatRequest if chat else CompletionRequest)
        if body.model != self.settings.model_name:
            raise OpenAIError(
                404,
                f"the model `{body.model}` does not exist; this server serves `{self.settings.model_name}`",
                param="model",
                code="model_not_found",
            )
        self._check_request_count(body, chat)  # before anything is tokenized or built
        ignored = ignored_fields(body)
        headers = {"Warning": f'299 kvwise "ignored: {", ".join(ignored)}"'} if ignored else None
        prompts = self.chat_prompts(body) if chat else self.completion_prompts(body)
        params = self._sampling(body, chat, max(map(len, prompts)))
        kv = request_kv_settings(body, self.settings.kv_quant_options)
        shared_tokens = self.shared_tokens(body, caller, chat, prompts)
        compress_upto = None
        if body.kv_prefix is not None and body.kv_prefix.compress is not None:
            kv = compression_settings(body, kv, self.settings.kv_quant_options)
            compress_upto = self._prefix_length(body, chat, prompts)
        auto = kv_auto(body, kv, self.core.controller is not None)
        if kv is None and auto is None and self.settings.default_kv_quant is not None:
            kv = resolve(Mix(quant=self.settings.default_kv_quant))
        turns = sum(message.role == "user" for message in body.messages) if chat else 0
        requests = []
        for prompt_index, token_ids in enumerate(prompts):
            try:
                for index in range(params.n):
                    request = self.core.make_request(
                        token_ids, params, index, tenant=caller.tenant, kv=kv, compress_upto=compress_upto, kv_auto=auto
                    )
                    request.turns = turns
                    request.shared_prefix_tokens = shared_tokens
                    request.may_publish_shared = caller.may_write_shared
                    request.choice = prompt_index * params.n + index
                    requests.append(request)
            except ValueError as error:
                if not isinstance(error, ContextLengthError):  # `param`: the field at fault, when known
                    raise OpenAIError(400, str(error), param=getattr(error, "param", None)) from None
                raise OpenAIError(
                    413, str(error), param="messages" if chat else "prompt", code="context_length_exceeded"
                ) from None
        events = self.engine.submit(requests)
        formatter = Formatter(self.settings.model_name, chat, self.core.tokenizer)
        prompt_tokens = sum(map(len, prompts))
        top = (body.top_logprobs or 0) if chat else (body.logprobs or 0)  # alternatives per token
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            stream = self._stream(http, formatter, requests, events, params, prompt_tokens, include_usage, top)
            headers = {"Cache-Control": "no-cache", **(headers or {})}
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        completions = await self._wait(http, requests, events)
        if completions is None:  # the client hung up: its requests are cancelled, nobody reads an answer
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        cached = self._cached_tokens(requests, params.n)
        return JSONResponse(
            formatter.response(completions, prompt_tokens, top, kv_usage(requests), cached, echo=_echo(body, prompts)),
            headers=headers,
        )

    async def _parse(self, http: Request, model):
        raw = await read_body(http, self.settings.max_body_bytes, self.settings.body_timeout_seconds)
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise OpenAIError(422, f"the body is not valid JSON: {error}", code="malformed_json") from None
        except RecursionError:
            raise OpenAIError(400, "the body nests too deeply", code="malformed_json") from None
        if not isinstance(data, dict):
            raise OpenAIError(422, "the body must be a JSON object", code="malformed_json")
        check_json_values(data)
        try:
            return model.model_validate(data)
        except ValidationError as error:
            first = error.errors()[0]
            field = ".".join(str(part) for part in first["loc"])
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in error.errors()[:5])
            raise OpenAIError(422, f"invalid request: {problems}", param=field or None, code="invalid_field") from None

    def shared_tokens(self, body, caller: Caller, chat: bool, prompts: list[list[int]]) -> int:
        """Leading prompt tokens to keep in the shared namespace: the `kv_prefix` segment when it
        is marked shared (or the key or header asks for sharing); for chat without a `kv_prefix`,
        the leading system and developer messages. Never the rest of the prompt, nor the output."""
        marked = body.kv_prefix
        wanted = caller.shared_prefix or (marked is not None and marked.shared)
        if not wanted:
            return 0
        if not (caller.may_read_shared or caller.may_write_shared):
            raise OpenAIError(403, "this key may not use the shared namespace", param="kv_prefix")
        return self._prefix_length(body, chat, prompts)

    def _prefix_length(self, body, chat: bool, prompts: list[list[int]]) -> int:
        """The prompt tokens the `kv_prefix` segment covers (for chat without one: the leading
        system and developer messages)."""
        marked = body.kv_prefix
        if marked is not None and (marked.messages is None) == (marked.tokens is None):
            raise OpenAIError(400, "kv_prefix takes exactly one of `messages` and `tokens`", param="kv_prefix")
        if marked is not None and marked.tokens is not None:
            longest = min(map(len, prompts))
            if marked.tokens > longest:
                raise OpenAIError(
                    400, f"kv_prefix.tokens is {marked.tokens}, the prompt has {longest} tokens", param="kv_prefix"
                )
            return marked.tokens
        if not chat:
            if marked is not None:
                raise OpenAIError(400, "kv_prefix.messages needs /v1/chat/completions; use tokens", param="kv_prefix")
            return 0
        if marked is not None:
            count = marked.messages
        else:
            count = next((i for i, m in enumerate(body.messages) if m.role not in ("system", "developer")), 0)
        if count > len(body.messages):
            raise OpenAIError(400, f"kv_prefix.messages is {count}, the request has {len(body.messages)}")
        if count == 0:
            return 0
        messages = [{"role": m.role, "content": m.text()} for m in body.messages[:count]]
        template = self.settings.chat_template
        try:
            head = self.core.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
        except Exception as error:  # templates raise their own exception types (jinja2, ValueError)
            message = f"the chat template refused the marked messages: {error}"
            raise OpenAIError(400, message, param="kv_prefix") from None
        head_ids = self.core.encode(head, add_special_tokens=False) if head else []
        if prompts[0][: len(head_ids)] != head_ids:
            raise OpenAIError(
                400,
                f"the chat template does not render the first {count} messages as a prefix of the prompt",
                param="kv_prefix",
            )
        return len(head_ids)

    def _check_request_count(self, body, chat: bool) -> None:
        """`n` completions of each prompt are `n x prompts` engine requests; more than the queue
        holds can never be admitted, so they are refused at once (n = 10**9 included)."""
        if body.n < 1:
            raise OpenAIError(400, f"n must be >= 1, got {body.n}", param="n")
        prompts = 1
        if not chat and isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int):
            prompts = len(body.prompt)
        if body.n * prompts > self.settings.max_queue:
            raise OpenAIError(
                400,
                f"n x prompts = {body.n * prompts} completions, more than this server queues at once "
                f"({self.settings.max_queue}); send fewer",
                param="n",
            )

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        try:
            return [self.core.encode(item) for item in prompt]
        except ValueError as error:
            raise OpenAIError(400, str(error), param="prompt") from None

    def chat_prompts(self, body: ChatRequest) -> list[list[int]]:
        tokenizer = self.core.tokenizer
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        template = self.settings.chat_template
        if not has_chat_template(tokenizer, template):
            raise OpenAIError(400, f"this model has no chat template; {NO_TEMPLATE_SERVER_HINT}", param="messages")
        try:
            text = render_chat(tokenizer, messages, template)
        except Exception as error:  # templates raise their own exception types (jinja2, ValueError)
            raise OpenAIError(400, f"the chat template refused these messages: {error}", param="messages") from None
        return [self.core.encode(text, add_special_tokens=False)]  # the template holds the special tokens

    def _sampling(self, body, chat: bool, longest_prompt: int) -> SamplingParams:
        prompt_logprobs = None if chat else scored_prompt(body)
        max_tokens = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
        if max_tokens == 0 and not chat and body.echo:
            max_tokens = 1  # the prompt alone is scored; the one token computed with it is not returned
        if max_tokens is None:
            room = (self.core.max_positions or longest_prompt + self.settings.default_max_tokens) - longest_prompt
            max_tokens = max(1, min(self.settings.default_max_tokens, room))
        if chat:
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            if body.top_logprobs is not None and not body.logprobs:
                raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        else:
            logprobs = body.logprobs
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=body.seed,
                stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
                n=body.n,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                ignore_eos=body.ignore_eos,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                min_p=body.min_p,
                stop_token_ids=list(body.stop_token_ids or []),
            )
        except ValueError as error:
            raise OpenAIError(400, str(error)) from None

    # ---- answers -------------------------------------------------------------------------------
    async def _wait(self, http: Request, requests, events: asyncio.Queue):
        """Every request's CompletionOutput, or None when the client went away (they are cancelled)."""
        remaining, poll = set(requests), self.settings.disconnect_poll_seconds
        checked = time.monotonic()
        try:
            while remaining:
                try:
                    item = await asyncio.wait_for(events.get(), poll)
                except TimeoutError:
                    item = None
                if time.monotonic() - checked >= poll:  # also while tokens keep coming
                    checked = time.monotonic()
                    if await http.is_disconnected():  # not an exception: uvicorn logs a traceback for each
                        return None
                if item is None:
                    continue
                if isinstance(item, EngineFailure):
                    raise OpenAIError(500, str(item))
                if item.finish_reason is not None:
                    remaining.discard(item.request)
        finally:
            if remaining:
                self.engine.abort(list(remaining))
        completions = []
        for request in requests:
            completion = request.completion
            completion.index = request.choice
            completions.append(completion)
        return completions

    def _cached_tokens(self, requests, n: int) -> int:
        """Prompt tokens served from the prefix cache, counted once per prompt (its first choice,
        as prompt_tokens counts each prompt once)."""
        return sum(self.engine.cached_tokens(request) for request in requests if request.choice % n == 0)

    async def _stream(self, http, formatter: Formatter, requests, events, params, prompt_tokens, include_usage, top):
        texts = {
            request: IncrementalText(self.core.tokenizer, params.stop, self.core.eos, params.stop_token_ids)
            for request in requests
        }
        remaining = set(requests)
        seen = dict.fromkeys(requests, 0)  # tokens whose events arrived, per request
        sent = dict.fromkeys(requests, 0)  # of those, tokens whose logprobs went out

        def logprobs_since(request, final: bool):
            """Logprobs of the tokens behind the text sent now (an EOS that ended it excluded)."""
            if request.logprobs is None:
                return None
            upto = seen[request]
            if final and upto and params.stops_at(request.output[upto - 1], self.core.eos):
                upto -= 1
            tokens, entries = request.output[sent[request] : upto], request.logprobs[sent[request] : upto]
            sent[request] = max(upto, sent[request])
            return formatter.logprobs(tokens, entries, top)

        try:
            if formatter.chat:
                for request in requests:
                    yield _sse(formatter.chunk(request.choice, None, None, first=True))
            while remaining:
                item = await events.get()
                if isinstance(item, EngineFailure):
                    yield _sse(OpenAIError(500, str(item)).body())
                    return
                request, final = item.request, item.finish_reason is not None
                seen[request] += 1
                delta = texts[request].add(item.token, final)
                if delta:
                    yield _sse(formatter.chunk(request.choice, delta, None, logprobs=logprobs_since(request, final)))
                if final:
                    remaining.discard(request)
                    yield _sse(formatter.chunk(request.choice, None, item.finish_reason))
            if include_usage:
                completion_tokens = sum(len(r.completion.token_ids) for r in requests)
                cached = self._cached_tokens(requests, params.n)
                yield _sse(formatter.usage_chunk(prompt_tokens, completion_tokens, kv_usage(requests), cached))
            yield "data: [DONE]\n\n"
        finally:
            if remaining:  # the client went away (the generator was cancelled or closed)
                self.engine.abort(list(remaining))


def scored_prompt(body) -> int | None:
    """SamplingParams.prompt_logprobs for a completion request: echo with logprobs, or vLLM's
    prompt_logprobs field (the larger of the two when both ask). 400 for what cannot be served."""
    if body.stream and (body.echo or body.prompt_logprobs is not None):
        field = "echo" if body.echo else "prompt_logprobs"
        raise OpenAIError(400, f"{field} with stream is not supported; leave out stream", param=field)
    asked = [value for value in (body.logprobs if body.echo else None, body.prompt_logprobs) if value is not None]
    return max(asked) if asked else None


def _echo(body, prompts: list[list[int]]):
    """What `Formatter.response` echoes: (the prompts' token ids, whether the output is dropped,
    vLLM's prompt_logprobs asked), or None."""
    chat = not hasattr(body, "echo")
    if chat or not (body.echo or body.prompt_logprobs is not None):
        return None
    return Echo(
        prompts, body.n, echo=body.echo, score_only=body.max_tokens == 0, by_id=body.prompt_logprobs is not None
    )


def ignored_fields(body) -> list[str]:
    """The fields of `body` that are accepted and ignored (`IGNORED_FIELDS`); a 400 naming the first
    field that would change the answer in a way kvwise does not serve (`UNSUPPORTED_FIELDS`)."""
    for name in UNSUPPORTED_FIELDS:
        value = getattr(body, name)
        if (
            name in ("tool_choice", "function_call")
            and value in ("none", "auto")
            and not (body.tools or body.functions)
        ):
            continue  # "no tools" with no tools: nothing changes
        if value:  # an empty list or map is the default
            raise OpenAIError(400, f"`{name}` is not supported by this server", param=name, code="unsupported_field")
    if body.response_format is not None and body.response_format.type != "text":
        raise OpenAIError(
            400,
            f"response_format of type {body.response_format.type} is not supported (only text)",
            param="response_format",
            code="unsupported_field",
        )
    return [name for name in IGNORED_FIELDS if getattr(body, name) is not None]


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
