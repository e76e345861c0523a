"""`LLM`: the offline API, shaped like vLLM's: `LLM().generate(prompts, SamplingParams(...))`.

    from kvwise import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2
    for output in llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8)):
        print(output.outputs[0].text)

Requests are batched continuously over one paged block pool with a radix prefix cache; shared
prompt prefixes are computed once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from kvwise.core.block_pool import BlockPool
from kvwise.core.radix import RadixCache
from kvwise.engine.request import Request
from kvwise.engine.runner import ModelRunner
from kvwise.engine.sampling import SamplingParams, find_stop, sample
from kvwise.engine.scheduler import Scheduler, default_namespace
from kvwise.hf.geometry import kv_geometry, paged_storage_for


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    requests: list = field(default_factory=list, repr=False)


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 2048
    token_budget: int = 1024  # tokens computed per step (prefill chunks + decodes); 1024 was fastest on CPU of 512/1024/2048
    max_running: int = 64
    prefix_caching: bool = True


class LLM:
    def __init__(self, model=None, cache_config: CacheConfig | None = None, tokenizer=None, device: str = "auto"):
        """model: None (the embedded SmolLM2), an HF id or folder, or a loaded transformers model."""
        if model is None or isinstance(model, str):
            from kvwise.models import load_model

            model, tokenizer = load_model(model, device=device)
        self.model, self.tokenizer = model, tokenizer
        self.cache_config = config = cache_config or CacheConfig()
        self.max_positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        self.pool = BlockPool(config.num_blocks, config.block_size)
        self.storage = paged_storage_for(model, config.num_blocks, config.block_size)
        self.storage.attach(self.pool)
        self.tree = RadixCache(self.pool) if config.prefix_caching else None
        shape = kv_geometry(model)
        self.scheduler = Scheduler(
            self.pool,
            self.tree,
            default_namespace(shape.model_id, str(shape.dtype)),
            config.token_budget,
            config.max_running,
        )
        self.runner = ModelRunner(model, self.storage)
        self.peak_blocks = 0  # most blocks in use at once (benchmarks report peak KV memory)

    # ---- the offline API -----------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | None = None, use_tqdm: bool = True):
        """prompts: a string, a list of strings, or lists of token ids. Returns RequestOutputs in order."""
        params = sampling_params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        outputs, groups = [], []
        for prompt in prompts:
            token_ids = self._encode(prompt)
            output = RequestOutput("", prompt if isinstance(prompt, str) else None, token_ids)
            group = [self._add(token_ids, params, index) for index in range(params.n)]
            output.request_id = group[0].request_id
            outputs.append(output)
            groups.append(group)
        self._run(sum(len(group) for group in groups), use_tqdm)
        for output, group in zip(outputs, groups):
            output.outputs = [request.completion for request in group]
            output.requests = group  # timings and reuse, for benchmarks
        return outputs

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True):
        """messages: one conversation (a list of {"role", "content"}) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    # ---- internals -------------------------------------------------------------------------------
    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids or LLM(..., tokenizer=...)")
            token_ids = self.tokenizer(prompt, add_special_tokens=False).input_ids
        else:
            token_ids = [int(token) for token in prompt]
        if not token_ids:
            raise ValueError("a prompt must have at least one token")
        return token_ids

    def _add(self, token_ids: list[int], params: SamplingParams, index: int) -> Request:
        total = len(token_ids) + params.max_tokens
        if self.max_positions is not None and total > self.max_positions:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens and asks for {params.max_tokens} more, "
                f"but the model's maximum context is {self.max_positions}"
            )
        seed = None if params.seed is None else params.seed + index
        request = Request(
            list(token_ids),
            params,
            index=index,
            generator=None if seed is None else torch.Generator(self.model.device).manual_seed(seed),
            logprobs=[] if params.logprobs is not None else None,
        )
        self.scheduler.add(request)
        return request

    def _run(self, total: int, use_tqdm: bool) -> None:
        eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        with tqdm(total=total, desc="generate", unit="request", disable=not use_tqdm) as progress:
            while self.scheduler.running or self.scheduler.waiting:
                step = self.scheduler.schedule()
                if not step.chunks:
                    raise RuntimeError("the block pool is too small for the next request")
                logits = self.runner.forward(step.chunks)
                self.peak_blocks = max(self.peak_blocks, self.pool.stats().used)
                finishing = [chunk for chunk in step.chunks if chunk.end >= len(chunk.request.prompt)]
                rows = [index for index, chunk in enumerate(step.chunks) if chunk in finishing]
                sampled = sample(
                    logits[rows], [c.request.params for c in finishing], [c.request.generator for c in finishing]
                )
                for chunk in step.chunks:
                    if chunk not in finishing:
                        self.scheduler.complete(chunk, None)
                for chunk, token in zip(finishing, sampled):
                    request = chunk.request
                    self.scheduler.complete(chunk, token.token)
                    if request.first_token_time is None:
                        request.first_token_time = time.monotonic()
                    if request.logprobs is not None:
                        request.logprobs.append({token.token: token.logprob, **token.top})
                    reason = self._finish_reason(request, token.token, eos)
                    if reason is not None:
                        request.completion = self._completion(request, reason)
                        request.finish_time = time.monotonic()
                        self.scheduler.finish(request)
                        progress.update()

    def _finish_reason(self, request: Request, token: int, eos: int | None) -> str | None:
        params = request.params
        if not params.ignore_eos and eos is not None and token == eos:
            return "stop"
        if params.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(request.output, skip_special_tokens=True)
            if find_stop(text, params.stop) is not None:
                return "stop"
        return "length" if len(request.output) >= params.max_tokens else None

    def _completion(self, request: Request, reason: str) -> CompletionOutput:
        token_ids = list(request.output)
        eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        if reason == "stop" and token_ids and token_ids[-1] == eos:
            token_ids = token_ids[:-1]
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        if reason == "stop" and request.params.stop:
            cut = find_stop(text, request.params.stop)
            text = text if cut is None else text[:cut]
        return CompletionOutput(request.index, text, token_ids, reason, request.logprobs)
