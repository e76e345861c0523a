"""The engine path of `kvwise bench ppl`: the same tokens scored through the serving engine.

The first chunk is prefilled; a mix with a quantizer freezes it at once, as a compressed document
is (`compress_upto`). Every later token is then read one a step by forced-token decoding
(`decode_from`), so it attends the KV a generation would hold at that point: settled tokens
quantized and read by the decode kernel, a cap evicting as it goes. The prompt logprobs that the
engine returns for those tokens (`SamplingParams.prompt_logprobs`) give the perplexity: what a
server holding that KV would score, not what the library's cache scores.
"""

from __future__ import annotations

import math
import time

import torch
from tqdm import tqdm

from kvwise.bench.ppl_report import short_quant
from kvwise.engine.kv_settings import resolve
from kvwise.engine.sampling import SamplingParams
from kvwise.hf.cache import full_kv_bytes

WARMUP_TOKENS = 48  # a forced-decoding warm-up, so one-time costs (kernel loads) land on no system


def engine_mix(config: dict) -> str | None:
    """The engine's spelling of a ppl system: h2o@max=1024+kivi4, int8, ... (None: full)."""
    parts = []
    if config["policy"] != "full":
        parts.append(f"{config['policy']}@max={config['max_kv_tokens']}")
    if config["quant"]:
        parts.append(short_quant(config["quant"]))
    return "+".join(parts) or None


class EngineScorer:
    """Scores token ids under a KV mix through one engine (prefix caching off: nothing is shared)."""

    def __init__(self, model, tokenizer):
        from kvwise.engine.llm import LLM

        self.engine = LLM(model, tokenizer=tokenizer, enable_prefix_caching=False).engine

    def warm_up(self, ids: torch.Tensor, chunk: int, quant: str | None) -> None:
        head = ids[:, : min(ids.shape[1], chunk + WARMUP_TOKENS)]
        for mix in (None, quant):
            self.score(head, {"policy": "full", "max_kv_tokens": None, "quant": mix}, min(chunk, head.shape[1] - 1))

    def score(self, ids: torch.Tensor, config: dict, chunk: int) -> tuple[float, float, int]:
        """(negative log-likelihood summed over ids[:, 1:], seconds, KV bytes held at the end) of
        ids [1, n] under the ppl system `config`."""
        token_ids = ids[0].tolist()
        kv = resolve(engine_mix(config))
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        quantizes = kv is not None and kv.quantizer is not None
        request = self.engine.make_request(
            token_ids, params, kv=kv, compress_upto=chunk if quantizes else None, decode_from=chunk
        )
        held, began = 0, time.perf_counter()
        self.engine.add(request)
        with tqdm(total=len(token_ids), desc=engine_mix(config) or "full", unit="token", leave=False) as progress:
            while self.engine.has_work:
                self.engine.step()
                if not request.done:  # once done its blocks are released
                    held = self.engine.kv.request_bytes(request)
                progress.update(request.computed - progress.n)
        seconds = time.perf_counter() - began
        if request.error:
            raise RuntimeError(f"the engine failed scoring {engine_mix(config) or 'full'}: {request.error}")
        nll = -sum(entry[token] for entry, token in zip(request.prompt_logprobs[1:], token_ids[1:]))
        return nll, seconds, held


def measure_in_engine(scorer: EngineScorer, model, ids: torch.Tensor, entry: dict, chunk: int) -> dict:
    """One system's row on the engine path (one pass: its quality is what this path measures;
    speed has `bench throughput` and `bench decode`)."""
    nll, seconds, held = scorer.score(ids, entry["config"], chunk)
    num_targets = ids.shape[1] - 1
    return {
        **entry,
        "ppl": math.exp(nll / num_targets),
        "kv_bytes": held,
        "full_kv_bytes": full_kv_bytes(model, num_targets, model.dtype.itemsize),
        "full16_kv_bytes": full_kv_bytes(model, num_targets, 2),
        "tokens_per_second": num_targets / seconds,
        "seconds": seconds,
    }
