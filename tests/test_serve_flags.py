"""`kvwise serve`'s flags as vLLM users spell them: a positional model, memory sizing, one API
key, a server-wide KV dtype, a YAML config file, --version and defaults in --help; the parsing
alone, then one live server started with all of them and driven by the `openai` client."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import openai
import pytest

from kvwise.cli import build_parser
from kvwise.server.serve import config_file_defaults, kv_memory_flag, model_flag, parse_bytes
from tests.live_server import LiveServer

pytestmark = pytest.mark.timeout(600)


def _serve_parser():
    parser = build_parser()
    return parser, parser._subparsers._group_actions[0].choices["serve"]


def _args(*flags):
    return build_parser().parse_args(["serve", *flags])


def test_sizes_and_aliases():
    assert parse_bytes("4GiB") == 4 << 30 and parse_bytes("512MiB") == 512 << 20 and parse_bytes("1000") == 1000
    assert parse_bytes("1.5GB") == 1_500_000_000
    with pytest.raises(argparse.ArgumentTypeError, match="not a size in bytes"):
        parse_bytes("lots")
    args = _args("/models/x", "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--no-enable-prefix-caching")
    assert model_flag(args) == "/models/x"
    assert (args.max_running, args.token_budget, args.prefix_caching) == (8, 512, False)
    old = _args("--max-running", "3", "--token-budget", "256", "--no-prefix-caching")  # the old spellings still work
    assert (old.max_running, old.token_budget, old.prefix_caching) == (3, 256, False)
    with pytest.raises(ValueError, match="two models"):
        model_flag(_args("/models/x", "--model", "/models/y"))
    assert kv_memory_flag(_args("--kv-cache-memory", "1GiB")) == 1 << 30 == kv_memory_flag(_args("--kv-budget-gb", "1"))
    with pytest.raises(ValueError, match="one knob"):
        kv_memory_flag(_args("--kv-cache-memory", "1GiB", "--kv-budget-gb", "2"))
    with pytest.raises(ValueError, match="--num-blocks fixes the pool"):
        kv_memory_flag(_args("--num-blocks", "64", "--kv-cache-memory", "1GiB"))


def test_config_file_values_are_defaults_that_flags_override(tmp_path):
    parser, serve = _serve_parser()
    config = tmp_path / "c.yaml"
    config.write_text("max-model-len: 2048\nmax_num_seqs: 4\nkv-cache-memory: 1GiB\nkv-class-mix: [chat=snapkv@0.5]\n")
    defaults = config_file_defaults(serve, str(config))
    assert defaults == {
        "max_model_len": 2048,
        "max_running": 4,
        "kv_cache_memory": 1 << 30,
        "kv_class_mix": ["chat=snapkv@0.5"],
    }
    serve.set_defaults(**defaults)
    args = parser.parse_args(["serve", "--config", str(config), "--max-num-seqs", "9"])
    assert (args.max_model_len, args.max_running, args.kv_cache_memory) == (2048, 9, 1 << 30)
    config.write_text("no-enable-prefix-caching: true\nno-fair-queue: true\nkv-class-mix: chat=full\n")
    assert config_file_defaults(serve, str(config)) == {
        "prefix_caching": False,
        "no_fair_queue": True,
        "kv_class_mix": ["chat=full"],
    }
    config.write_text("max-modle-len: 10\n")
    with pytest.raises(ValueError, match="unknown key 'max-modle-len'"):
        config_file_defaults(serve, str(config))
    config.write_text("kv-cache-memory: lots\n")
    with pytest.raises(ValueError, match="kv-cache-memory: not a size"):
        config_file_defaults(serve, str(config))


def test_version_and_help_defaults():
    run = [sys.executable, "-m", "kvwise.cli"]
    version = subprocess.run([*run, "serve", "--version"], capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("kvwise ")
    shown = subprocess.run([*run, "serve", "--help"], capture_output=True, text=True, timeout=120).stdout
    assert "(default: 256)" in shown and "--max-model-len" in shown and "--gpu-memory-utilization" in shown


@pytest.mark.smollm
def test_a_server_started_the_vllm_way(tmp_path):
    from kvwise.models import _converted_embedded_dir

    config = tmp_path / "c.yaml"
    config.write_text("max-num-seqs: 4\nkv-cache-memory: 512MiB\n")
    model = str(_converted_embedded_dir())
    server = LiveServer(
        model,
        "--max-model-len",
        "4096",
        "--kv-cache-dtype",
        "kivi4",
        "--api-key",
        "sk-only",
        "--config",
        str(config),
        "--log-level",
        "info",
        "--log-requests",
        "--log-stats-interval",
        "1",
    )
    try:
        name = "SmolLM2-135M-Instruct"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0).models.list()
        api = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="sk-only", max_retries=0)
        assert [m.id for m in api.models.list()] == [name]
        reply = api.completions.create(model=name, prompt="The sky is", max_tokens=4, temperature=0)
        assert "kivi4" in reply.usage.kv["mix"]  # the server-wide KV dtype
        with pytest.raises(openai.APIStatusError, match="maximum context is 4096"):
            api.completions.create(model=name, prompt=[1] * 4095, max_tokens=8)
        time.sleep(1.2)  # a stats line follows the first step after its interval
        api.completions.create(model=name, prompt="The sky is", max_tokens=2, temperature=0)
    finally:
        assert server.stop() == 0
    log = server.process.stdout.read()
    # 512 MiB of KV memory, 70% of it the pool: 509 blocks of 16 float32 SmolLM2 tokens (720 KiB each)
    assert "KV pool: 509 blocks of 16 tokens" in log, log[-2000:]
    assert "engine: prompt" in log and "tok/s" in log  # the periodic stats line
    assert "outcome=length" in log and "prompt_tokens=" in log  # one line per request...
    assert "The sky is" not in log  # ...without its text unless --log-request-text


def test_every_flag_is_documented():
    from pathlib import Path

    documented = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    _, serve = _serve_parser()
    missing = [
        option
        for action in serve._actions
        if action.help != argparse.SUPPRESS
        for option in action.option_strings
        if f"`{option}`" not in documented and option not in ("-h", "--help")
    ]
    assert not missing, f"flags missing from docs/configuration.md: {missing}"
