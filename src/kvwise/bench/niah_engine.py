"""`kvwise bench niah --paths engine`: the same needle trials through the serving engine (`kvwise.LLM`).

The context is compressed once, query-agnostically (`compress_upto`: the question is read after
the compression), or with the question (`--mode aware`: all but the last prompt token, as the
library path's aware mode). Policy options travel with the policy (`kvzip:recent_window=64`).
`kv_bytes` is what the request really holds in the engine's pool right after compression: its
head pages (or quantized pages and sinks) and any blocks, not a mask.
"""

from __future__ import annotations

import time

from kvwise.engine.config import CacheConfig
from kvwise.engine.kv_settings import resolve
from kvwise.engine.llm import LLM
from kvwise.engine.sampling import SamplingParams
from kvwise.hf.cache import full_kv_bytes
from kvwise.kv.quantizer import make_quantizer
from kvwise.kv.stored_form import StoredForm
from kvwise.policies.mix import Mix
from kvwise.policies.registry import make_policy

BLOCK_SIZE = 16


def engine_for(model, tokenizer, longest: int) -> LLM:
    """One engine for every trial: room for the longest prompt and KVzip's pass over it (about as
    long again), no prefix cache (each trial stands alone, as in the library path)."""
    blocks = 3 * -(-longest // BLOCK_SIZE) + 16
    config = CacheConfig(block_size=BLOCK_SIZE, num_blocks=blocks, token_budget=max(512, longest), prefix_caching=False)
    return LLM(model=model, tokenizer=tokenizer, cache_config=config)


class EngineTrials:
    """Trials through one engine (`engine_for`), for `run_niah`."""

    def __init__(self, model, tokenizer, longest: int, new_tokens: int = 8):
        self.model, self.llm, self.new_tokens = model, engine_for(model, tokenizer, longest), new_tokens

    def page_tokens(self, quant: str | None) -> int:
        """Tokens of one head in one page of what a compressed context is held in. Unquantized,
        a head's last page is padded (half a page per head on average, which a byte budget pays
        for); a quantized mix fills it with its next-best tokens (`fill_pages`), as the library
        does."""
        if quant is None:
            return self.llm.engine.kv.page_tokens
        return StoredForm.of(make_quantizer(quant)).page_tokens()

    def refuses(self, policy: str, ratio: float, quant, options) -> str | None:
        """Why the engine does not run this cell (one line), or None."""
        try:
            resolve(_mix(policy, ratio, quant, options))
        except ValueError as error:
            return str(error)
        return None

    def __call__(self, prompt, name, ratio, mode, quant=None, options=()) -> dict:
        measured = run_engine_trial(self.llm, prompt, name, ratio, mode, self.new_tokens, quant, options)
        compressed = measured["compressed_tokens"]
        measured["full_kv_bytes"] = full_kv_bytes(self.model, compressed, self.model.dtype.itemsize)
        measured["full16_kv_bytes"] = full_kv_bytes(self.model, compressed, 2)
        return measured


def run_engine_trial(
    llm: LLM, prompt, policy: str, ratio: float, mode: str, new_tokens: int, quant=None, options=()
) -> dict:
    """One trial through `llm`: compress, ask, decode greedily. Returns the measured fields."""
    context = prompt.context_ids[0].tolist()
    whole = context + prompt.question_ids[0].tolist()
    upto = len(context) if mode == "agnostic" else len(whole) - 1
    evicts = not make_policy(policy).keeps_everything and ratio > 0
    settings = _mix(policy, ratio, quant, options) if evicts or quant else None
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    started = time.perf_counter()
    output = llm.generate([whole], params, use_tqdm=False, kv=settings, compress_upto=upto if evicts else None)[0]
    seconds = time.perf_counter() - started
    request = output.requests[0]
    kv = llm.engine.kv
    held = request.compressed_kv_bytes if evicts else -(-upto // kv.block_size) * kv.block_bytes
    return {
        "kv_bytes": held,
        "compressed_tokens": upto,
        "seconds": seconds,
        "answer": output.outputs[0].text,
    }


def _mix(policy: str, ratio: float, quant, options) -> Mix:
    """A cell's mix: a policy that keeps everything ("full") takes no ratio."""
    keeps = make_policy(policy, **dict(options)).keeps_everything
    return Mix(policy if not keeps else "full", 0.0 if keeps else ratio, quant=quant, options=() if keeps else options)
