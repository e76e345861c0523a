"""Does kvwise compute what the model computes? Equality checks for any transformers model.

`kvwise check-model DIR` runs them on a user's model; the architecture matrix in the tests runs
them on a tiny model of every supported family. Each check returns a `Verdict`:

- engine: the paged engine's logits after every sampled step equal the model's own forward over
  the same tokens (relative to the largest logit), and its greedy tokens equal `model.generate`;
  for a batch of prompts of mixed lengths, chunked prefill, with prefix reuse on or off and the
  CPU decode kernel on or off;
- full cache: `KVWiseCache(policy="full")` gives the logits of the model's own cache;
- ratio 0: after `compress_context`, with nothing evicted, the continuation equals the model's;
- budgets: after compression at a ratio, every full-attention layer holds exactly its budget, at
  the original positions and with the model's own keys there, and every sliding-window layer
  holds exactly the window the model's own cache holds.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch

from kvwise.hf.attention import attention_implementation
from kvwise.policies.selection import kept_per_head

# float32: what the engine's reordered reductions (paged blocks, fused kernels) move logits by
ENGINE_TOLERANCE = 1e-4
CACHE_TOLERANCE = 1e-5


@dataclass
class Verdict:
    check: str
    passed: bool
    detail: str
    measures: dict = field(default_factory=dict)

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.check}: {self.detail}"


@contextlib.contextmanager
def reference_attention(model):
    """The model's own attention while the block runs (eager where SDPA cannot express the
    model, e.g. soft-capped logits), then whatever the model used before."""
    previous = attention_implementation(model)
    capped = getattr(model.config.get_text_config(decoder=True), "attn_logit_softcapping", None)
    try:
        model.set_attn_implementation("sdpa" if not capped else "eager")
    except ValueError:  # a model without an SDPA path
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def relative_error(reference: torch.Tensor, other: torch.Tensor) -> float:
    """max |reference - other| over the largest |reference| (at least 1); 0 for empty tensors."""
    if reference.numel() == 0:
        return 0.0
    scale = max(1.0, float(reference.abs().max()))
    return float((reference.float() - other.float()).abs().max()) / scale


def greedy_config(model, max_tokens: int):
    """The model's generation config, greedy for `max_tokens` tokens, never stopping early at EOS."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.pad_token_id = None, 0
    config.do_sample, config.max_new_tokens, config.min_new_tokens = False, max_tokens, None
    return config


def model_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """`model.generate` greedy with the model's own cache, never stopping early at EOS."""
    config = greedy_config(model, max_tokens)
    with reference_attention(model), torch.no_grad():
        ids = torch.tensor([prompt], device=model.device)
        return model.generate(ids, generation_config=config)[0, len(prompt) :].tolist()


def model_logits(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: the model's own forward, no cache."""
    with reference_attention(model), torch.no_grad():
        return model(input_ids=torch.tensor([tokens], device=model.device), use_cache=False).logits[0]


def check_engine(
    model,
    prompt_batches: list[list[list[int]]],
    *,
    prefix_caching: bool = True,
    cpu_kernel: bool = True,
    block_size: int = 4,
    token_budget: int = 12,
    max_tokens: int = 8,
    tolerance: float = ENGINE_TOLERANCE,
) -> Verdict:
    """Each batch is added after the previous one finished, so later batches can hit the prefix
    cache; a token budget below the prompt lengths chunks the prefills and mixes them with decodes."""
    from kvwise.engine.config import CacheConfig
    from kvwise.engine.core import EngineCore
    from kvwise.engine.sampling import SamplingParams

    previous = attention_implementation(model)
    longest = max(len(prompt) for batch in prompt_batches for prompt in batch) + max_tokens
    blocks = sum(len(batch) for batch in prompt_batches) * (-(-longest // block_size) + 1) + 8
    config = CacheConfig(
        block_size=block_size,
        num_blocks=blocks,
        token_budget=token_budget,
        prefix_caching=prefix_caching,
        swap_space_bytes=0,
    )
    core = EngineCore(model, None, config, cpu_kernel=cpu_kernel)
    observed: dict[int, list[tuple[int, torch.Tensor]]] = {}

    def observe(chunks, logits):
        for chunk, row in zip(chunks, logits):
            if chunk.end >= chunk.request.prefill_target:
                observed.setdefault(id(chunk.request), []).append((chunk.end, row.detach().clone()))

    core.logits_observer = observe
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = []
    try:
        for batch in prompt_batches:
            group = [core.make_request(list(prompt), params) for prompt in batch]
            for request in group:
                core.add(request)
            while core.has_work:
                core.step()
            requests.extend(group)
    finally:
        model.set_attn_implementation(previous)
    worst, mismatched = 0.0, 0
    for request in requests:
        reference = model_logits(model, request.prompt + request.output)
        for end, row in observed[id(request)]:
            worst = max(worst, relative_error(reference[end - 1], row))
        if request.output != model_greedy(model, request.prompt, max_tokens):
            mismatched += 1
    reused = sum(request.reused for request in requests)
    mode = f"prefix reuse {'on' if prefix_caching else 'off'}, CPU kernel {'on' if cpu_kernel else 'off'}"
    detail = (
        f"{len(requests)} prompts ({mode}): logits max relative error {worst:.1e} (tolerance {tolerance:.0e}), "
        f"greedy tokens {'equal' if not mismatched else f'differ on {mismatched} prompts'}, {reused} tokens reused"
    )
    passed = worst <= tolerance and not mismatched
    return Verdict("engine", passed, detail, {"logit_error": worst, "mismatched": mismatched, "reused": reused})


def _generate_logits(model, ids: torch.Tensor, max_tokens: int, cache=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [1, n], logits [steps, vocab]) of greedy generate, with `cache` or the model's own."""
    config = greedy_config(model, max_tokens)
    config.output_logits, config.return_dict_in_generate = True, True
    with torch.no_grad():
        out = model.generate(ids, generation_config=config, **({} if cache is None else {"cache": cache}))
    return out.sequences, torch.cat(out.logits)


def check_full_cache(model, ids: list[int], max_tokens: int = 6, tolerance: float = CACHE_TOLERANCE) -> Verdict:
    """KVWiseCache(policy="full") against the model's own cache, prefill then decode."""
    from kvwise.hf.cache import KVWiseCache

    previous = attention_implementation(model)
    prompt = torch.tensor([ids], device=model.device)
    with reference_attention(model):
        expected_tokens, expected = _generate_logits(model, prompt, max_tokens)
    try:
        tokens, logits = _generate_logits(model, prompt, max_tokens, KVWiseCache(model, "full"))
    finally:
        model.set_attn_implementation(previous)
    error = relative_error(expected, logits)
    same = torch.equal(expected_tokens, tokens)
    tokens_verdict = "equal" if same else "differ"
    detail = f"logits max relative error {error:.1e} (tolerance {tolerance:.0e}), tokens {tokens_verdict}"
    return Verdict("full cache", error <= tolerance and same, detail, {"logit_error": error})


def check_ratio_zero(
    model, context: list[int], question: list[int], policy: str = "snapkv", max_tokens: int = 6
) -> Verdict:
    """compress_context at ratio 0, then the question: the model's own continuation, exactly."""
    from kvwise.hf.cache import KVWiseCache

    previous = attention_implementation(model)
    whole = torch.tensor([context + question], device=model.device)
    with reference_attention(model):
        expected_tokens, expected = _generate_logits(model, whole, max_tokens)
    try:
        cache = KVWiseCache(model, policy, 0.0)
        cache.compress_context(torch.tensor([context], device=model.device))
        tokens, logits = _generate_logits(model, whole, max_tokens, cache)
    finally:
        model.set_attn_implementation(previous)
    error = relative_error(expected, logits)
    same = torch.equal(expected_tokens, tokens)
    detail = (
        f"{policy} at ratio 0 then a question: logits max relative error {error:.1e} "
        f"(tolerance {CACHE_TOLERANCE:.0e}), tokens {'equal' if same else 'differ'}"
    )
    return Verdict("ratio 0", error <= CACHE_TOLERANCE and same, detail, {"logit_error": error})


def check_budgets(model, context: list[int], policy: str, ratio: float, tokenizer=None) -> Verdict:
    """After compress_context: budgets, original positions and the model's own keys on the
    full-attention layers; the model's own window on the sliding layers."""
    from transformers import DynamicCache

    from kvwise.hf.cache import KVWiseCache
    from kvwise.hf.layer import CompressingLayer
    from kvwise.policies.registry import make_policy

    scorer = make_policy(policy)
    try:
        scorer.attach(model)
    except ValueError as error:  # a learned scorer not trained on this model yet (kvzap)
        return Verdict(f"budgets {policy}", True, f"not checked: {error}")
    previous = attention_implementation(model)
    ids = torch.tensor([context], device=model.device)
    with reference_attention(model), torch.no_grad():
        reference = DynamicCache(config=model.config)
        model(input_ids=ids, cache=reference, use_cache=True)
    try:
        cache = KVWiseCache(model, scorer, ratio, tokenizer=tokenizer)
        cache.compress_context(ids)
    finally:
        model.set_attn_implementation(previous)
    problems, kept_total = [], 0
    full_layers = [layer for layer in cache.layers if isinstance(layer, CompressingLayer)]
    for layer in full_layers:
        keys, _, valid = layer.padded()  # [1, kv_heads, max_len, dim]
        positions = layer.padded_positions(valid)
        expected_keys = reference.layers[layer.layer_idx].keys  # [1, kv_heads, len, dim]
        for head in range(keys.shape[1]):
            kept = positions[0, head][valid[0, head]].long()
            kept_total += kept.numel()
            if kept.unique().numel() != kept.numel() or bool((kept < 0).any() | (kept >= len(context)).any()):
                problems.append(f"layer {layer.layer_idx} head {head}: positions {kept.tolist()} are not original")
                continue
            stored = keys[0, head][valid[0, head]]
            if relative_error(expected_keys[0, head, kept], stored) > CACHE_TOLERANCE:
                problems.append(f"layer {layer.layer_idx} head {head}: kept keys differ from the model's there")
    budget = _expected_kept(cache, len(context), full_layers)
    if kept_total != budget:
        problems.append(f"full-attention layers hold {kept_total} entries, the budget is {budget}")
    for layer_idx, layer in enumerate(cache.layers):
        if isinstance(layer, CompressingLayer):
            continue
        mine, theirs = layer, reference.layers[layer_idx]
        if mine.keys.shape != theirs.keys.shape or relative_error(theirs.keys, mine.keys) > CACHE_TOLERANCE:
            problems.append(f"sliding layer {layer_idx} holds {tuple(mine.keys.shape)}, the model's window differs")
        elif mine.get_seq_length() != theirs.get_seq_length():
            problems.append(f"sliding layer {layer_idx} counts {mine.get_seq_length()} tokens, not {len(context)}")
    sliding = len(cache.layers) - len(full_layers)
    detail = (
        f"{policy} at ratio {ratio}: {kept_total} entries kept on {len(full_layers)} full-attention layers "
        f"(budget {budget}), {sliding} sliding layers"
    )
    if problems:
        detail += "; " + "; ".join(problems[:3])
    return Verdict(f"budgets {policy}", not problems, detail, {"kept": kept_total, "budget": budget})


def _expected_kept(cache, num_tokens: int, full_layers) -> int:
    """Entries the full-attention layers must hold: the ratio's share of every head of every layer,
    or all of them for a policy that keeps everything."""
    heads = sum(layer.num_kv_heads for layer in full_layers)
    if cache.policy.keeps_everything or cache.compression_ratio == 0:
        return heads * num_tokens
    return heads * kept_per_head(num_tokens, cache.compression_ratio)


def check_model(model, tokenizer, text: str, policies: list[str], ratio: float, progress=None) -> list[Verdict]:
    """Every check on a real model, with prompts cut from `text`: three of mixed lengths (the
    longest past the sliding window, if any), chunked by a token budget below the longest, and
    a second round that reuses their prefixes."""
    from kvwise.hf.chat_template import bos_ids
    from kvwise.hf.geometry import kv_geometry

    geometry = kv_geometry(model)
    windows = [window for window in geometry.windows if window is not None]
    longest = min(max(windows) + 48, 1024) if windows else 96
    bos = bos_ids(tokenizer)
    stream = tokenizer(text, add_special_tokens=False).input_ids
    if len(stream) < 2 * longest + 64:
        raise ValueError(f"the text has {len(stream)} tokens; the checks need at least {2 * longest + 64}")
    lengths = (max(4, longest // 6), max(8, longest // 2), longest)
    first = [bos + stream[i * longest : i * longest + length] for i, length in enumerate(lengths)]
    tail = stream[2 * longest : 2 * longest + 24]
    second = [first[1][: len(first[1]) * 3 // 4] + tail[:8], first[2][: len(first[2]) * 3 // 4] + tail[8:]]
    budget = max(16, longest // 3)
    context, question = first[2], tail[:12]
    runs = [
        lambda: check_engine(model, [first, second], block_size=16, token_budget=budget),
        lambda: check_engine(
            model, [first, second], prefix_caching=False, cpu_kernel=False, block_size=16, token_budget=budget
        ),
        lambda: check_full_cache(model, first[1]),
        lambda: check_ratio_zero(model, context, question),
        *[lambda policy=policy: check_budgets(model, context, policy, ratio, tokenizer) for policy in policies],
    ]
    verdicts = []
    for run in runs:
        verdicts.append(run())
        if progress is not None:
            progress(verdicts[-1])
    return verdicts
