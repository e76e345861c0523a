"""`kvwise serve --kv-policy auto` on the embedded SmolLM2 with its shipped profile, through the
official `openai` client: the mix chosen comes back in usage.kv, a class hint is honoured, explicit
settings win, bad hints get a specific 400, decisions reach /metrics; and bad adaptive flags stop
the server at startup with an error naming the flag."""

from __future__ import annotations

import openai
import pytest

from tests.live_server import LiveServer

pytestmark = [pytest.mark.smollm, pytest.mark.timeout(600)]

MODEL = "SmolLM2-135M-Instruct"
PASSAGE = " ".join(f"Shelf {n} holds a {c} jar of honey." for n, c in enumerate(["amber", "pale", "dark"] * 40))


@pytest.fixture(scope="module")
def server():
    live = LiveServer("--kv-policy", "auto", "--kv-budget-gb", "1", "--kv-class-mix", "chat=snapkv@0.5")
    yield live
    assert live.stop() == 0


def api(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def ask(server, **extra):
    messages = [{"role": "user", "content": PASSAGE + "\n\nWhich shelf holds the first dark jar?"}]
    return api(server).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=extra or None
    )


def test_auto_reports_the_mix_it_chose(server):
    kv = ask(server).usage.model_extra["kv"]
    assert kv["class"] == "retrieval"  # a long prompt and a short answer
    assert kv["reason"] == "spare" and kv["mix"] == "full"  # one request in a 1 GiB budget: memory to spare
    hinted = ask(server, kv_profile="chat").usage.model_extra["kv"]
    assert hinted == {
        "mix": "snapkv@0.5",
        "class": "chat",
        "reason": "pinned",
        "predicted_quality": hinted.get("predicted_quality"),
    }
    explicit = ask(server, kv_mix="streaming_llm@0.5").usage.model_extra["kv"]
    assert explicit["reason"] == "explicit" and explicit["mix"] == "streaming_llm@0.5"


def test_bad_hints_are_specific_400s(server):
    with pytest.raises(openai.BadRequestError, match="unknown kv_profile 'fast'"):
        ask(server, kv_profile="fast")


def test_decisions_reach_the_metrics(server):
    ask(server)
    choices = server.value("kvwise_adaptive_actions_total", action="choose", reason="spare")
    assert choices >= 1
    assert server.value("kvwise_adaptive_predicted_quality", **{"class": "retrieval"}) == 1.0
    assert server.value("kvwise_adaptive_actions_total", action="choose", reason="pinned") >= 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-policy", "auto", "--kv-quality", "1.5"], "--kv-quality: the quality floor must be in (0, 1]"),
        (["--kv-policy", "auto", "--kv-class-mix", "chat"], "--kv-class-mix takes CLASS=MIX"),
        (["--kv-policy", "auto", "--kv-class-mix", "batch=full"], "unknown request class 'batch'"),
        (["--kv-class-mix", "chat=full"], "need --kv-policy auto"),
        (["--kv-budget-gb", "0.01"], "fewer than the longest request (8192 tokens) needs"),
        (["--kv-policy", "auto", "--kv-profile", "/nonexistent.json"], "cannot read the profile"),
    ],
)
def test_bad_adaptive_flags_stop_the_server_at_startup(flags, message, capsys):
    from kvwise.cli import main

    assert main(["serve", "--port", "1", *flags]) == 2  # before any port is bound or model loaded
    assert message in capsys.readouterr().err


def test_kv_profile_needs_an_auto_server(smollm):
    from kvwise.engine.config import CacheConfig
    from kvwise.engine.core import EngineCore
    from kvwise.server.app import ServerSettings, create_app
    from tests.inprocess_server import InProcessServer

    model, tokenizer = smollm
    core = EngineCore(model, tokenizer, CacheConfig(num_blocks=256))
    try:
        with InProcessServer(create_app(core, ServerSettings(MODEL))) as plain:
            with pytest.raises(openai.BadRequestError, match="needs a server started with --kv-policy auto"):
                ask(plain, kv_profile="chat")
    finally:
        model.set_attn_implementation("kvwise")


def test_every_dashboard_panel_queries_an_exported_series(server):
    import json
    import re
    from pathlib import Path

    import httpx

    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    families = re.findall(r"^# TYPE (\S+) ", text, flags=re.MULTILINE)  # with or without samples
    exported = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in families}
    dashboard = Path(__file__).resolve().parents[1] / "examples" / "observability" / "grafana-dashboard.json"
    panels = json.loads(dashboard.read_text())["panels"]
    assert len(panels) >= 10
    for panel in panels:
        for target in panel["targets"]:
            names = set(re.findall(r"kvwise_[a-z0-9_]+", target["expr"]))
            assert names, panel["title"]
            series = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in names}
            assert series <= exported, f"{panel['title']}: {sorted(series - exported)} are not exported"
