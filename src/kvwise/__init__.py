"""kvwise: KV-cache management for LLM inference (reuse, eviction, compression, tiers)."""

from kvwise._version import __version__
from kvwise.adaptive import factory as _adaptive_factory  # noqa: F401  registers LLM(kv="auto")'s controller
from kvwise.engine.kv_settings import KVSettings, resolve
from kvwise.engine.llm import LLM, CacheConfig
from kvwise.engine.sampling import SamplingParams
from kvwise.hf.cache import KVWiseCache
from kvwise.hf.pipeline import register as _register_pipeline
from kvwise.kv.quantizer import make_quantizer, quantizer_names
from kvwise.models import load_model
from kvwise.policies.mix import Mix, parse_mix
from kvwise.policies.registry import make_policy, policy_names

_register_pipeline()  # pipeline("kvwise-text-generation", ...), as kvpress's

__all__ = [
    "LLM",
    "CacheConfig",
    "KVSettings",
    "Mix",
    "parse_mix",
    "resolve",
    "SamplingParams",
    "KVWiseCache",
    "load_model",
    "make_policy",
    "make_quantizer",
    "policy_names",
    "quantizer_names",
    "__version__",
]
