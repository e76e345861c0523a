"""`kvwise bench adaptive`: the mixed workload (classes, disjoint from the calibration essays,
seeded arrivals), the long-chat workload (growing histories, a closed loop), the doc-store workload
(documents with key sentences, Zipf reuse, one host tier for all), the report from its rows, and
small end-to-end runs of each on the embedded model."""

from __future__ import annotations

import json

import pytest

from kvwise.adaptive.controller import DOCUMENT_CACHED, DOCUMENT_COMPRESSED, DOCUMENT_NEW, DOCUMENT_REUSED
from kvwise.adaptive.probes import calibration_text
from kvwise.bench.adaptive import AdaptiveBenchConfig, aggregate, markdown, run_adaptive_bench
from kvwise.bench.adaptive_workload import CLASSES, WorkloadSpec, at_rate, build_workload
from kvwise.bench.doc_store import DocStoreSpec, build_doc_store
from kvwise.bench.long_chat import LongChatSpec, build_long_chat
from kvwise.util.essays import split_essays

pytestmark = [pytest.mark.timeout(600)]


def test_the_bench_text_and_the_calibration_text_are_disjoint():
    bench, calibration = split_essays()
    assert calibration == calibration_text()[0]
    sample = calibration[1000:1200]
    assert sample not in bench and bench[5000:5200] not in calibration


@pytest.mark.smollm
def test_the_workload_is_seeded_and_mixed(smollm):
    _, tokenizer = smollm
    spec = WorkloadSpec(requests=20, retrieval_tokens=(300, 400), chat_tokens=(300, 400))
    first, again = build_workload(tokenizer, spec), build_workload(tokenizer, spec)
    assert [r.prompt for r in first] == [r.prompt for r in again]
    counts = {klass: sum(r.klass == klass for r in first) for klass in CLASSES}
    assert counts == {"retrieval": 8, "chat": 6, "short": 4, "long_generation": 2}
    for request in first:
        if request.klass == "retrieval":
            assert request.answer in tokenizer.decode(request.prompt)
    other = build_workload(tokenizer, WorkloadSpec(requests=20, seed=1, retrieval_tokens=(300, 400)))
    assert [r.prompt for r in other] != [r.prompt for r in first]
    arrivals = at_rate(first, 2.0)
    assert arrivals == sorted(arrivals) and arrivals[-1] == pytest.approx(first[-1].arrival / 2)
    with pytest.raises(ValueError, match="four non-negative proportions"):
        WorkloadSpec(proportions=(1.0, 0.0))


def _row(system, quality, tps, budget=0.3, repeat=0):
    classes = dict.fromkeys(CLASSES, quality)
    return {
        "system": system, "budget": budget, "repeat": repeat, "quality": quality, "tokens_per_second": tps,
        "retrieval_accuracy": 1.0, "full_retrieval_accuracy": 1.0, "ttft_p50_s": 1.0, "ttft_p99_s": 2.0,
        "preemptions": 0, "peak_kv_bytes": 100, "compressed_requests": 1, "class_quality": classes,
        "actions": {"choose:spare": 2}, "budget_bytes": 1000,
    }  # fmt: skip


def test_repeats_give_means_and_a_spread():
    merged = aggregate([_row("auto", 0.99, 10.0), _row("auto", 0.97, 12.0, repeat=1), _row("full", 1.0, 5.0)])
    auto = next(row for row in merged if row["system"] == "auto")
    assert auto["quality"] == pytest.approx(0.98) and auto["tokens_per_second"] == pytest.approx(11.0)
    assert auto["spread"]["tokens_per_second"] == pytest.approx(2.0 / 11.0)
    assert auto["actions"] == {"choose:spare": 4}
    report = {
        "config": {"workload": {"requests": 3, "proportions": [0.4, 0.3, 0.2, 0.1], "seed": 0, "haystack_dir": None},
                   "quality": 0.98, "model": None},
        "system": {"kvwise": "0", "device": "cpu", "hardware": "x"},
        "rate": 1.0, "rate_source": "given", "peak_demand_bytes": 1000,
        "results": [_row("auto", 0.99, 10.0), _row("full", 1.0, 5.0)],
    }  # fmt: skip
    table = markdown(report)
    assert "| auto | 0.990 |" in table and "| 2.00x |" in table


@pytest.mark.smollm
def test_a_small_run_end_to_end(tmp_path):
    spec = WorkloadSpec(
        requests=5, retrieval_tokens=(300, 400), chat_tokens=(300, 400), long_prompt_tokens=(50, 80),
        long_output_tokens=40, proportions=(0.4, 0.2, 0.2, 0.2),
    )  # fmt: skip
    config = AdaptiveBenchConfig(workload=spec, systems=("full", "kivi4", "auto"), budgets=(0.5,), rate=5.0)
    report = run_adaptive_bench(config, tmp_path)
    rows = {row["system"]: row for row in report["results"]}
    assert rows["full"]["quality"] == 1.0  # full under a budget computes what full computes unlimited
    assert rows["kivi4"]["compressed_requests"] == 5
    assert 0 < rows["kivi4"]["quality"] <= 1 and 0 < rows["auto"]["quality"] <= 1
    assert all(row["tokens_per_second"] > 0 and row["peak_kv_bytes"] > 0 for row in rows.values())
    assert rows["auto"]["actions"]  # every decision is counted
    again = run_adaptive_bench(config, tmp_path)  # every run is read back, none repeated
    assert [row["wall_seconds"] for row in again["results"]] == [row["wall_seconds"] for row in report["results"]]
    saved = json.loads((tmp_path / "adaptive.json").read_text())
    assert saved["rate"] == 5.0 and (tmp_path / "adaptive.md").exists() and (tmp_path / "adaptive.png").exists()


@pytest.mark.smollm
def test_a_long_chat_grows_each_history_from_the_last_turn(smollm):
    _, tokenizer = smollm
    spec = LongChatSpec(conversations=3, turns=3, history_tokens=(600, 900), reply_tokens=(8, 16))
    turns = build_long_chat(tokenizer, spec)
    assert [r.prompt for r in turns] == [r.prompt for r in build_long_chat(tokenizer, spec)]  # seeded
    assert len(turns) == 9 and all(r.klass == "long_chat" for r in turns)
    for conversation in range(3):
        first, *later = turns[3 * conversation : 3 * conversation + 3]
        assert first.follows is None and first.arrival == 0.0
        previous = first
        for turn in later:
            assert turn.follows == previous.index  # sent when the turn before it ends
            assert turn.prompt[: len(previous.prompt)] == previous.prompt  # the history, token for token
            assert len(turn.prompt) > len(previous.prompt) + 100
            previous = turn
        assert 500 <= len(previous.prompt) <= 1100 and 8 <= previous.max_tokens <= 16
    with pytest.raises(ValueError, match="history tokens must be increasing"):
        LongChatSpec(history_tokens=(900, 600))


@pytest.mark.smollm
def test_a_small_long_chat_run_end_to_end(tmp_path):
    spec = LongChatSpec(conversations=2, turns=2, history_tokens=(400, 500), reply_tokens=(8, 12))
    config = AdaptiveBenchConfig(workload=spec, systems=("full", "kivi4"), budgets=(0.5,))
    report = run_adaptive_bench(config, tmp_path)
    assert report["workload_name"] == "long-chat" and report["rate_source"] == "closed loop"
    rows = {row["system"]: row for row in report["results"]}
    assert rows["full"]["quality"] == 1.0 and set(rows["full"]["class_quality"]) == {"long_chat"}
    # kivi4's replies are scored by the likelihood of full's replies under its settings, in the engine
    assert rows["kivi4"]["compressed_requests"] == 4 and 0.5 < rows["kivi4"]["quality"] <= 1
    table = (tmp_path / "adaptive.md").read_text()
    assert "long chat: 2 conversations of 2 turns" in table and "| long chat |" in table
    assert "the output tok/s of full with unlimited memory" in table


@pytest.mark.smollm
def test_a_doc_store_asks_about_popular_documents_again(smollm):
    _, tokenizer = smollm
    spec = DocStoreSpec(documents=6, document_tokens=(200, 300), requests=30, clients=2)
    requests = build_doc_store(tokenizer, spec)
    assert [r.prompt for r in requests] == [r.prompt for r in build_doc_store(tokenizer, spec)]  # seeded
    assert [r.follows for r in requests[:4]] == [None, None, 0, 1]  # each client waits for its last answer
    documents: dict[tuple, set] = {}
    for request in requests:
        document = tuple(request.prompt[: request.document_end])
        documents.setdefault(document, set()).add(request.answer)
        text = tokenizer.decode(request.prompt[request.document_end :])
        assert "access code" in text and text.rstrip().endswith("file is")
    assert all(len(codes) == 1 for codes in documents.values())  # one key per document
    for document, (code,) in documents.items():
        assert f"file is {code}." in tokenizer.decode(document)
    asked = sorted((sum(tuple(r.prompt[: r.document_end]) == d for r in requests) for d in documents), reverse=True)
    assert asked[0] >= 2 * asked[-1] and len(documents) >= 4  # Zipf: a few are asked about again and again
    with pytest.raises(ValueError, match="2 to"):
        DocStoreSpec(documents=1)
    with pytest.raises(ValueError, match="must contain"):
        DocStoreSpec(key_sentence="the code is {key}")
    own = DocStoreSpec(
        documents=3, document_tokens=(100, 120), requests=4, key_sentence=" The {name} ledger holds {key}. ",
        question="Which number does the {name} ledger hold?", answer_prefix="The {name} ledger holds",
    )  # fmt: skip
    for request in build_doc_store(tokenizer, own):
        assert f"ledger holds {request.answer}." in tokenizer.decode(request.prompt[: request.document_end])
        assert "Which number does the" in tokenizer.decode(request.prompt[request.document_end :])


@pytest.mark.smollm
def test_a_small_doc_store_run_end_to_end(tmp_path):
    # the pool holds 3 requests of ~370 tokens; the documents asked about, ~2.5K tokens in full
    spec = DocStoreSpec(documents=10, document_tokens=(260, 320), requests=16, clients=2, zipf_exponent=1.0)
    config = AdaptiveBenchConfig(workload=spec, systems=("full", "kvzip@0.75+kivi4", "auto"), budgets=(1.0,))
    report = run_adaptive_bench(config, tmp_path)
    assert report["workload_name"] == "doc-store" and report["documents_bytes"] > 0
    rows = {row["system"]: row for row in report["results"]}
    assert rows["full"]["quality"] == 1.0 and set(rows["full"]["class_quality"]) == {"doc_store"}
    assert rows["full"]["document_hits"] > 0  # its documents come back from the pool or the host tier
    assert rows["kvzip@0.75+kivi4"]["compressed_requests"] == 16 and rows["kvzip@0.75+kivi4"]["document_hits"] > 0
    reasons = {name.split(":", 1)[1] for name in rows["auto"]["actions"] if name.startswith("choose:")}
    assert reasons and reasons <= {DOCUMENT_NEW, DOCUMENT_CACHED, DOCUMENT_REUSED, DOCUMENT_COMPRESSED}
    table = (tmp_path / "adaptive.md").read_text()
    assert "doc store: 16 questions over 10 documents" in table and "vs full TTFT p50" in table
    with pytest.raises(ValueError, match="leaves no host tier"):
        run_adaptive_bench(AdaptiveBenchConfig(workload=spec, systems=("full",), budgets=(0.01,)), tmp_path / "small")


def test_any_kv_mix_runs_as_a_fixed_system_and_a_bad_name_is_refused():
    assert AdaptiveBenchConfig(systems=("full", "kvzip@0.75+int8", "auto")).systems[1] == "kvzip@0.75+int8"
    with pytest.raises(ValueError, match=r"unknown systems \['nosuchpolicy@0.5'\].*or any KV mix"):
        AdaptiveBenchConfig(systems=("full", "nosuchpolicy@0.5"))
