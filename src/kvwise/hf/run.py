"""One prompt through a compressing cache, with a report of the memory it held."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwise.hf.cache import KVWiseCache, full_kv_bytes
from kvwise.hf.generation import greedy_continue


@dataclass
class GenerationReport:
    completion: str
    prompt_tokens: int
    full_kv_bytes: int
    compressed_kv_bytes: int
    policy: str
    ratio: float
    quant: str | None = None

    @property
    def compression(self) -> float:
        return self.full_kv_bytes / max(1, self.compressed_kv_bytes)

    def summary(self) -> str:
        return (
            f"policy={self.policy} ratio={self.ratio} quant={self.quant} prompt_tokens={self.prompt_tokens} "
            f"kv_bytes_before={self.full_kv_bytes:,} kv_bytes_after={self.compressed_kv_bytes:,} "
            f"compression={self.compression:.1f}x"
        )


def encode_prompt(tokenizer, prompt: str, chat: bool) -> torch.Tensor:
    """[1, seq_len] token ids, through the chat template when the tokenizer has one."""
    if chat and tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    return tokenizer(prompt, return_tensors="pt").input_ids


def generate_with_report(
    prompt: str,
    model_and_tokenizer,
    policy: str = "snapkv",
    ratio: float = 0.5,
    max_new_tokens: int = 64,
    max_kv_tokens: int | None = None,
    chat: bool = True,
    quant: str | None = None,
) -> GenerationReport:
    """Prefill `prompt` into a compressing cache of `model_and_tokenizer` (a loaded model and its
    tokenizer), then generate from it.

    "Before" is what an uncompressed cache holds for the same prompt, in the model's dtype.
    """
    model, tokenizer = model_and_tokenizer
    input_ids = encode_prompt(tokenizer, prompt, chat).to(model.device)
    cache = KVWiseCache(
        model, policy=policy, compression_ratio=ratio, max_kv_tokens=max_kv_tokens, tokenizer=tokenizer, quant=quant
    )
    cache.check_length(input_ids.shape[1] + max_new_tokens)
    with torch.no_grad():
        cache.compress_context(input_ids[:, :-1])
        full_bytes = full_kv_bytes(model, input_ids.shape[1] - 1, model.dtype.itemsize)
        compressed_bytes = cache.nbytes()
        new_ids = greedy_continue(model, cache, input_ids[:, -1:], max_new_tokens)
    ids = new_ids[0].tolist()
    if tokenizer.eos_token_id in ids:
        ids = ids[: ids.index(tokenizer.eos_token_id)]
    return GenerationReport(
        completion=tokenizer.decode(ids, skip_special_tokens=True),
        prompt_tokens=int(input_ids.shape[1]),
        full_kv_bytes=full_bytes,
        compressed_kv_bytes=compressed_bytes,
        policy=policy,
        ratio=ratio,
        quant=quant,
    )
