"""Named cache settings for common mixes of eviction and quantization.

    KVWiseCache.from_preset(model, "rag-4bit", tokenizer=tokenizer)

Each preset says what it is for; docs/guide.md and docs/benchmarks.md show what each costs and keeps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CacheSettings:
    policy: str = "full"
    compression_ratio: float = 0.0
    quant: str | None = None
    max_kv_tokens: int | None = None
    purpose: str = ""

    def as_kwargs(self) -> dict:
        settings = asdict(self)
        settings.pop("purpose")
        return settings


PRESETS = {
    "int8": CacheSettings(quant="int8", purpose="near-lossless: half of a 16-bit cache, no eviction"),
    "kivi4": CacheSettings(quant="kivi4", purpose="4-bit KIVI: about 0.32 of a 16-bit cache, ppl within 0.3%"),
    "kivi2": CacheSettings(quant="kivi2", purpose="2-bit KIVI: about 0.20 of a 16-bit cache, some quality lost"),
    "rag-4bit": CacheSettings(
        policy="kvzip",
        compression_ratio=0.75,
        quant="kivi4",
        purpose="compress a document once (query-agnostic), keep a quarter of it in 4 bits: ~1/13 of 16-bit",
    ),
    "long-decode": CacheSettings(
        policy="h2o",
        max_kv_tokens=1024,
        quant="kivi4",
        purpose="long generations: at most 1024 tokens per head, stored in 4 bits",
    ),
}


def preset(name: str) -> CacheSettings:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]
