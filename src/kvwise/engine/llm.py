"""`LLM`: the offline API, shaped like vLLM's: `LLM().generate(prompts, SamplingParams(...))`.

    from kvwise import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2
    for output in llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8)):
        print(output.outputs[0].text)

Requests are batched continuously over one paged block pool with a radix prefix cache; shared
prompt prefixes are computed once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from dataclasses import fields as fields_of

from tqdm import tqdm

from kvwise.engine.config import CacheConfig
from kvwise.engine.controllers import build_controller
from kvwise.engine.core import CompletionOutput, EngineCore
from kvwise.engine.kv_budget import cache_config_for_memory
from kvwise.engine.kv_settings import KVSettings, resolve
from kvwise.engine.sampling import SamplingParams
from kvwise.hf.chat_template import load_chat_template, render_chat
from kvwise.policies.mix import Mix
from kvwise.tiers.base import Tier

__all__ = ["LLM", "CacheConfig", "CompletionOutput", "KVSettings", "Mix", "RequestOutput"]


@dataclass
class RequestOutput:
    """One prompt's result, as vLLM's: `outputs` holds its `n` completions; num_cached_tokens: its
    prompt tokens found in the prefix cache instead of computed (its first completion's)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    requests: list = field(default_factory=list, repr=False)
    num_cached_tokens: int = 0
    finished: bool = False
    # SamplingParams.prompt_logprobs: per prompt token {token: logprob, top alternatives...}, None first
    prompt_logprobs: list[dict[int, float] | None] | None = None


class LLM:
    def __init__(
        self,
        model=None,
        cache_config: CacheConfig | None = None,
        tokenizer=None,
        device: str = "auto",
        tiers: Sequence[Tier] = (),
        kv: str | None = None,
        kv_budget_bytes: int | None = None,
        kv_quality: float = 0.98,
        kv_profile_path: str | None = None,
        dtype=None,
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        kv_cache_memory: int | None = None,
        enable_prefix_caching: bool | None = None,
        **cache_kwargs,
    ):
        """model: None (the embedded SmolLM2), an HF id or folder, or a loaded transformers model.
        tiers: where evicted prefix-cache blocks spill (e.g. [HostTier(2 << 30), DiskTier(dir)]).
        kv="auto": the adaptive controller picks each request's KV mix (requests given a mix of
        their own keep it) from the model's calibration profile (`kvwise calibrate`; one ships
        for the embedded model), keeping predicted quality per class at least `kv_quality` of the
        full cache's. kv_budget_bytes: all the KV memory it may use (pool and host swap), which
        sizes the pool instead of `cache_config.num_blocks`.

        As in vLLM: dtype (of weights loaded here), max_model_len (the longest prompt and output),
        gpu_memory_utilization (CUDA: the share of the device's memory in use once the KV cache is
        sized), kv_cache_memory (bytes of KV memory, CPU or CUDA: the same knob as kv_budget_bytes),
        enable_prefix_caching; any other keyword is a CacheConfig field (block_size, num_blocks,
        token_budget, max_running, ...)."""
        if model is None or isinstance(model, str):
            from kvwise.models import load_model

            model, tokenizer = load_model(model, device=device, dtype=dtype)
        elif dtype is not None:
            raise ValueError("dtype applies to a model loaded here; convert a loaded model yourself")
        cache_config = _cache_config(cache_config, enable_prefix_caching, cache_kwargs)
        budgets = [b for b in (kv_budget_bytes, kv_cache_memory) if b is not None]
        if len(budgets) == 2 and budgets[0] != budgets[1]:
            raise ValueError("kv_cache_memory and kv_budget_bytes are one knob: give one")
        kv_memory = budgets[0] if budgets else None
        sized = cache_config_for_memory(model, cache_config, kv_memory, gpu_memory_utilization, max_model_len)
        cache_config = sized or cache_config
        if kv not in (None, "auto"):
            raise ValueError(f"kv must be None or 'auto', got {kv!r} (per-prompt settings go to generate(kv=...))")
        controller = None
        if kv == "auto":  # the adaptive layer registers it (engine.controllers)
            controller = build_controller("auto", model, quality=kv_quality, profile_path=kv_profile_path)
        self.engine = EngineCore(model, tokenizer, cache_config, tiers)
        if max_model_len is not None:
            if max_model_len < 1:
                raise ValueError(f"max_model_len must be positive, got {max_model_len}")
            self.engine.max_positions = min(max_model_len, self.engine.max_positions or max_model_len)
        if controller is not None:
            self.engine.attach_controller(controller)
        self.model, self.tokenizer, self.cache_config = model, tokenizer, self.engine.cache_config

    @property
    def scheduler(self):
        return self.engine.scheduler

    @property
    def peak_blocks(self) -> int:
        return self.engine.kv.peak_blocks

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        kv: str | Mix | KVSettings | list[str | Mix | KVSettings | None] | None = None,
        compress_upto: int | list[int | None] | None = None,
    ):
        """prompts: a string, a list of strings, or lists of token ids. Returns RequestOutputs in order.

        sampling_params: one for every prompt, or one per prompt.

        kv: a KV mix for every prompt, or one per prompt (None: keep everything), as a spec such
        as "snapkv@0.5" or "kvzip@0.9+kivi4", or a `Mix`; it compresses only that request's
        private tokens.
        compress_upto: per prompt (or one for all), how many leading tokens (a document) the
        ratio compresses before the rest (a question) is read: query-agnostic compression.
        Default: the whole prompt, with its question, when its prefill ends.
        Every prompt is checked before any runs: one that does not fit raises and nothing is queued."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        sampling_params = sampling_params or SamplingParams()
        each = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        settings = [resolve(one) for one in kv] if isinstance(kv, list) else [resolve(kv)] * len(prompts)
        points = compress_upto if isinstance(compress_upto, list) else [compress_upto] * len(prompts)
        for name, values in (("sampling_params", each), ("kv", settings), ("compress_upto", points)):
            if len(values) != len(prompts):
                raise ValueError(f"{name} has {len(values)} entries for {len(prompts)} prompts")
        outputs, groups = [], []
        for prompt, params, prompt_kv, point in zip(prompts, each, settings, points):
            token_ids = self.engine.encode(prompt)
            auto = "auto" if self.engine.controller is not None and prompt_kv is None else None
            group = [
                self.engine.make_request(token_ids, params, index, kv=prompt_kv, compress_upto=point, kv_auto=auto)
                for index in range(params.n)
            ]
            outputs.append(RequestOutput(group[0].request_id, prompt if isinstance(prompt, str) else None, token_ids))
            groups.append(group)
        for group in groups:
            for request in group:
                self.engine.add(request)
        with tqdm(total=sum(map(len, groups)), desc="generate", unit="request", disable=not use_tqdm) as progress:
            while self.engine.has_work:
                progress.update(sum(event.finish_reason is not None for event in self.engine.step()))
        for output, group in zip(outputs, groups):
            output.outputs = [request.completion for request in group]
            output.requests = group  # timings and reuse, for benchmarks
            output.num_cached_tokens = group[0].reused
            output.prompt_logprobs = group[0].prompt_logprobs
            output.finished = all(request.done for request in group)
        return outputs

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
    ):
        """messages: one conversation (a list of {"role", "content"}) or a list of them.

        chat_template: a Jinja template, or a file holding one, for tokenizers without their own
        (base models) or to override it."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template = load_chat_template(chat_template)
        prompts = [
            self.engine.encode(render_chat(self.tokenizer, conversation, template), add_special_tokens=False)
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)


def _cache_config(base: CacheConfig | None, prefix_caching: bool | None, fields: dict) -> CacheConfig | None:
    """`base` (or the defaults) with vLLM's enable_prefix_caching and any CacheConfig fields applied."""
    known = {f.name for f in fields_of(CacheConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"LLM() got unknown arguments {unknown}; CacheConfig fields are {sorted(known)}")
    if prefix_caching is not None:
        fields = {**fields, "prefix_caching": prefix_caching}
    if not fields:
        return base
    return replace(base or CacheConfig(), **fields)
