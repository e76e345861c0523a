"""`EngineCore`: one model, one block pool, one scheduler; `step()` runs one forward for every
scheduled request and reports the tokens it produced.

The offline `LLM` loops over `step()` until its requests are done; the server runs the same loop
on a background thread and streams the events. Nothing here is thread-safe: one thread owns it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from kvwise.engine.compaction import Compaction
from kvwise.engine.config import CacheConfig
from kvwise.engine.context_pass import PassChunk, PassDeferred, start_pass
from kvwise.engine.detokenizer import IncrementalText
from kvwise.engine.kv_manager import KVCacheManager
from kvwise.engine.kv_settings import KVSettings, resolve
from kvwise.engine.kv_view import LastStep
from kvwise.engine.request import Request, Status
from kvwise.engine.runner import ForwardOutput, ModelRunner
from kvwise.engine.sampling import SamplingParams, find_stop, prompt_token_logprobs, sample
from kvwise.engine.scheduler import Scheduler
from kvwise.engine.step_profile import StepProfile
from kvwise.policies.mix import Mix
from kvwise.tiers.base import Tier
from kvwise.util.secret_keys import namespace_key as default_namespace_key

log = logging.getLogger("kvwise.engine")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length", or "error" (an internal fault)
    logprobs: list[dict[int, float]] | None = None
    # SamplingParams.prompt_logprobs: per prompt token {token: logprob, ...} (None for the first)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank (1: the likeliest)


@dataclass
class TokenEvent:
    """A token sampled for `request` in one step; `finish_reason` is set when it was the last.
    A request cancelled by an internal fault gets one event with token -1 and reason "error"."""

    request: Request
    token: int
    finish_reason: str | None


@dataclass
class StepRecord:
    """What one step computed: (request_id, tenant, start, end) per chunk (tests read the log)."""

    step: int
    chunks: list[tuple[str, str, int, int]]
    tier_seconds: float = 0.0  # wall time in prefix-tier calls (spills and fetches) during the step


class ContextLengthError(ValueError):
    """The prompt plus the tokens asked for do not fit the model's context."""


class EngineCore:
    def __init__(
        self,
        model,
        tokenizer=None,
        cache_config: CacheConfig | None = None,
        tiers: Sequence[Tier] = (),
        cpu_kernel: bool = True,
        namespace_key: bytes | Sequence[bytes] | None = None,
    ):
        """tiers: where evicted prefix-cache blocks go and come back from (HostTier, DiskTier,
        RedisTier, searched in that order); needs prefix caching. cpu_kernel=False keeps SDPA and
        torch's linear on CPU (as KVWISE_CPU_KERNEL=0 does). namespace_key keys every block's
        identity (default: the key file under $KVWISE_HOME/secrets, made on first use); a list
        during a rotation: the first keys new blocks, the others still find blocks on the tiers."""
        self.model, self.tokenizer = model, tokenizer
        self.cache_config = config = cache_config or CacheConfig()
        self.max_positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        self.eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.kv = KVCacheManager.for_model(model, config, tiers)  # every byte of KV memory, and its bookkeeping
        self.scheduler = Scheduler(self.kv, config.token_budget, config.max_running)
        self.runner = ModelRunner(model, self.kv.runner_view(), cpu_kernel=cpu_kernel)
        self.profile: StepProfile | None = None  # while `profiling`
        # called with (chunks, logits [C, vocab]) after each forward: model checks compare them
        self.logits_observer = None
        self.controller = None  # an AdaptiveController, for requests whose KV mix is `auto` (attach_controller)
        self.steps = 0
        # for the server's timing pad (see hit_pad_seconds): recent prefill-only steps as (tokens,
        # attention pairs, cold, seconds), the cost model fitted on them (None: refit when asked),
        # the step just run as (tokens, pairs, cold, seconds, prefill only), and when it ended
        self._prefill_samples: deque[tuple[int, int, float, float]] = deque(maxlen=64)
        self._prefill_fit: list[float] | None = None
        self._last_step: tuple[int, int, float, float, bool] = (0, 0, 0.0, 0.0, False)
        self._last_step_ended = 0.0
        self.step_log: deque[StepRecord] = deque(maxlen=1024)
        self._last_step_timing: LastStep | None = None  # what a controller's cost model learns from
        keys = [namespace_key] if namespace_key is None or isinstance(namespace_key, bytes) else namespace_key
        self.set_namespace_keys([default_namespace_key(keys[0]), *keys[1:]])

    def set_namespace_keys(self, keys: Sequence[bytes]) -> None:
        """Rotate the namespace key: new requests' blocks are keyed with keys[0]; blocks the tiers
        hold under the others still come back (keyed anew on the device). Call it on the engine's
        thread (`AsyncEngine.call_soon`)."""
        if not keys:
            raise ValueError("set_namespace_keys needs at least one key")
        self.kv.set_namespace_keys(keys)

    def attach_controller(self, controller) -> None:
        """Let `controller` pick the mix of `auto` requests and relieve memory pressure. It offers
        two calls, each given a read-only `ControllerView`: `admit(request, view)` returns the
        request's `AssignMix` (or None) before its prefix is matched, and `before_step(view)` returns
        the actions for this step; the KV manager carries them out (`kv_actions`)."""
        self.controller = controller
        self._outcomes: list = []  # of the controller's last actions, shown in its next view
        self.scheduler.on_admitting.append(self._controller_admits)

    def _controller_admits(self, request: Request) -> None:
        scheduler = self.scheduler
        view = self.kv.controller_view(
            scheduler.running,
            self._stalls(),
            held_back=scheduler.waiting,
            last_step=self._last_step_timing,
            admitting=request,
        )
        action = self.controller.admit(request, view)
        if action is not None:
            outcome = self.kv.execute(action)
            if outcome.error is not None:  # the request runs with the full cache instead
                log.warning(
                    "the KV controller's mix %r for %s failed: %s", action.mix, request.request_id, outcome.error
                )

    def _controller_acts(self) -> None:
        scheduler = self.scheduler
        view = self.kv.controller_view(
            scheduler.running, self._stalls(), self._outcomes, scheduler.waiting, self._last_step_timing
        )
        self._outcomes = [self.kv.execute(action) for action in self.controller.before_step(view)]

    def _stalls(self) -> tuple[int, int]:
        return self.scheduler.memory_stalls, self.scheduler.preemptions

    # ---- requests ------------------------------------------------------------------------------
    def encode(self, prompt, add_special_tokens: bool = True) -> list[int]:
        """A string or token ids -> a non-empty list of ids.

        Text is tokenized as `model.generate(tokenizer(text))` would see it: with the tokenizer's
        special tokens (the BOS that Gemma and Llama 3 need); a rendered chat template holds them
        already and passes add_special_tokens=False."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids or a tokenizer")
            token_ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
        else:
            token_ids = [int(token) for token in prompt]
        if not token_ids:
            raise ValueError("a prompt must have at least one token")
        bad = next((token for token in token_ids if not 0 <= token < self.vocab_size), None)
        if bad is not None:  # caught here: inside a batched forward it would fail everyone's step
            raise ValueError(f"token id {bad} is outside the model's vocabulary of {self.vocab_size} tokens")
        return token_ids

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        if self.max_positions is not None and prompt_tokens + max_tokens > self.max_positions:
            raise ContextLengthError(
                f"the prompt has {prompt_tokens} tokens and asks for {max_tokens} more, "
                f"but the model's maximum context is {self.max_positions} tokens"
            )
        kv = self.kv
        if -(-(prompt_tokens + max_tokens) // kv.block_size) > kv.num_blocks:
            raise ContextLengthError(
                f"the prompt has {prompt_tokens} tokens and asks for {max_tokens} more, but the KV pool holds "
                f"{kv.num_blocks * kv.block_size} tokens in all"
            )

    def make_request(
        self,
        token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
        tenant: str = "default",
        kv: str | Mix | KVSettings | None = None,
        compress_upto: int | None = None,
        kv_auto: str | None = None,
        decode_from: int | None = None,
    ):
        """kv: the request's own KV mix for its private tokens (shared prefixes stay intact): a
        spec, a `Mix` or resolved settings (`kv_settings.resolve`, which this calls).
        kv_auto: let the adaptive controller choose its mix, for this class hint (retrieval, chat,
        long_generation, or auto: from its features); explicit `kv` settings win.
        compress_upto: its ratio compresses (and its quantizer quantizes) the first `compress_upto`
        tokens (a document) as soon as they are computed, before the rest of the prompt (the
        question) is read: query-agnostic compression. Default: the whole prompt when its
        prefill ends.
        decode_from: prompt tokens from this position on are read one a step, through the decode
        path, so their prompt logprobs are scored under the KV a generation would have there
        (settled tokens quantized, a cap evicting). Default: `compress_upto` when a KV mix
        compresses (for `kv_auto`, the mix the controller assigns) and prompt logprobs are asked
        for, else the whole prompt is prefilled."""
        self.check_fits(len(token_ids), params.max_tokens)
        kv = resolve(kv)
        if kv_auto is not None:
            if self.controller is not None:
                self.controller.check_hint(kv_auto)
            else:
                raise ValueError("an auto KV mix needs the adaptive controller: LLM(kv='auto'), serve --kv-policy auto")
        if compress_upto is not None:
            compresses = kv is not None and ((kv.ratio > 0 and kv.evicts) or kv.quantizer is not None)
            if kv_auto is None and not compresses:
                raise ValueError(
                    "compress_upto needs a KV mix with an evicting policy and a ratio above 0, or a quantizer"
                )
            if not 1 <= compress_upto <= len(token_ids):
                raise ValueError(
                    f"compress_upto must be between 1 and the prompt's {len(token_ids)} tokens, got {compress_upto}"
                )
        if decode_from is not None and not 1 <= decode_from <= len(token_ids):
            raise ValueError(
                f"decode_from must be between 1 and the prompt's {len(token_ids)} tokens, got {decode_from}"
            )
        if kv is not None and kv.quantizer is not None:  # caught here, not inside a batched step
            kv.quantizer.check_head_dim(self.kv.geometry.head_dim)
        if kv is not None:
            kv.scorer.attach(self.model)  # a learned scorer (kvzap) loads here, or its error names the fix
        seed = None if params.seed is None else params.seed + index
        return Request(
            list(token_ids),
            params,
            tenant=tenant,
            index=index,
            generator=None if seed is None else torch.Generator(self.model.device).manual_seed(seed),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] * len(token_ids) if params.prompt_logprobs is not None else None,
            prompt_ranks=[None] * len(token_ids) if params.prompt_logprobs is not None else None,
            kv=kv if kv is not None and kv.active else None,
            compress_upto=compress_upto,
            decode_from=decode_from,
            kv_auto=kv_auto if kv is None else None,
        )

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    def abort(self, request: Request) -> None:
        """Cancel a request wherever it is; its blocks are released (zeroed if nobody else holds them)."""
        if not request.done:
            self.scheduler.cancel(request)
            request.finish_time = time.monotonic()

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    # ---- one step ------------------------------------------------------------------------------
    @contextmanager
    def profiling(self) -> Iterator[StepProfile]:
        """Time each part of every step run inside (`StepProfile`); the timers go when it ends."""
        profile = StepProfile(self.runner.model.device)
        profile.attach_linear_hooks(self.runner.model)
        self.profile = self.runner.profile = profile
        try:
            yield profile
        finally:
            profile.detach()
            self.profile = self.runner.profile = None

    def step(self) -> list[TokenEvent]:
        """Schedule, run one forward for every scheduled chunk, then settle memory and sample."""
        if self.profile is None:
            return self._step()
        with self.profile.step():
            return self._step()

    def _step(self) -> list[TokenEvent]:
        tier_seconds = self.kv.prefix_stats.seconds_in_tiers  # scheduling fetches, evictions spill
        if self.controller is not None:
            self._controller_acts()
        step_started = time.perf_counter()  # after the controller's actions: a model of steps learns from it
        step = self.scheduler.schedule()
        if not step.chunks:
            return self._idle()
        self.steps += 1
        started = time.perf_counter()
        chunks, output, failed = self._forward_isolating_faults(step.chunks)
        self._measure_prefill(chunks, time.perf_counter() - started)
        record = StepRecord(self.steps, [(c.owner.request_id, c.owner.tenant, c.start, c.end) for c in step.chunks])
        self.step_log.append(record)
        # reconstruction passes' chunks only score: nothing is sampled after them
        passes = [chunk for chunk in chunks if isinstance(chunk, PassChunk)]
        rows = [index for index, chunk in enumerate(chunks) if not isinstance(chunk, PassChunk)]
        chunks, logits = [chunks[index] for index in rows], output.logits[rows] if rows else output.logits
        if self.logits_observer is not None:
            self.logits_observer(chunks, logits)
        self._record_prompt_logprobs(chunks, output.prompt_logits)
        failed += self._settle_memory(output, passes, failed)
        rows = [index for index, chunk in enumerate(chunks) if chunk.request.status is not Status.WAITING]
        if len(rows) < len(chunks):  # some went back to the queue to be recomputed: nothing is sampled for them
            chunks, logits = [chunks[index] for index in rows], logits[rows]
        events = self._postprocess(chunks, logits, failed)
        record.tier_seconds = self.kv.prefix_stats.seconds_in_tiers - tier_seconds
        if self.controller is not None:  # only a controller reads it
            decodes = sum(chunk.start >= len(chunk.owner.prompt) for chunk in step.chunks)
            self._last_step_timing = LastStep(
                time.perf_counter() - step_started, decodes, decodes == len(step.chunks) and not passes
            )
        return events

    def _timing(self, part: str):
        return self.profile.timing(part) if self.profile is not None else nullcontext()

    def _idle(self) -> list[TokenEvent]:
        if not self.has_work:
            return []
        raise RuntimeError(
            f"the engine cannot make progress: {len(self.scheduler.running)} running and "
            f"{len(self.scheduler.waiting)} waiting requests do not fit {self.kv.num_blocks} blocks"
        )

    def _settle_memory(self, output: ForwardOutput, passes: list[PassChunk], failed: list) -> list:
        """After the forward: the peak is recorded, compactions are applied (evicted tokens move to
        head pages, their blocks back to the pool) or, for KVzip, start their reconstruction pass;
        passes whose last chunk ran are applied; settled blocks are quantized. Returns
        [(request, error)] for the requests whose part of this raised."""
        self.kv.record_peak()
        troubled = {request for request, _ in failed}
        errors = []
        for compaction in output.compactions:
            if not isinstance(compaction, Compaction) or id(compaction.request) in troubled:
                continue
            try:
                if compaction.needs_context_pass:
                    compaction.request.reconstruction = start_pass(compaction, self.kv, self.tokenizer)
                else:
                    self.kv.apply_compaction(compaction.request, compaction)
            except PassDeferred:
                # other requests hold the blocks the pass needs: compute this one again later (its
                # output so far is kept), as a preemption would, instead of failing it
                self.scheduler.requeue_for_recompute(compaction.request)
            except Exception as error:  # noqa: BLE001 - that request alone fails
                errors.append((compaction.request, error))
        self.kv.record_peak()  # borrowed blocks included
        for chunk in passes:
            reconstruction = chunk.reconstruction
            if id(reconstruction.request) in troubled:
                continue
            reconstruction.done = chunk.end - reconstruction.start
            if reconstruction.remaining == 0:
                try:
                    self.kv.finish_reconstruction(reconstruction.request)
                except Exception as error:  # noqa: BLE001
                    errors.append((reconstruction.request, error))
        troubled |= {request for request, _ in errors}
        return errors + self.kv.quantize_settled([r for r in self.scheduler.running if r not in troubled])

    def _postprocess(self, chunks, logits, failed: list) -> list[TokenEvent]:
        """Sample after each chunk that reaches its request's prefill target (the prompt, or prompt
        + output after a recompute; earlier prompt chunks only fill the cache), record progress,
        and finish or fail requests."""
        rows = [index for index, chunk in enumerate(chunks) if chunk.end >= chunk.request.prefill_target]
        finishing = [chunks[index] for index in rows]
        with self._timing("sampling"):
            sampled = self._sample_isolating_faults(logits[rows] if rows else None, finishing, failed)
        for chunk in chunks:
            if chunk.end < chunk.request.prefill_target:
                self.scheduler.complete(chunk, None)
        events = [self._fail(request, error) for request, error in failed]
        for chunk, token in zip(finishing, sampled):
            request = chunk.request
            if token is None or request.done:
                continue  # its failure is already in `events`
            self.scheduler.complete(chunk, token.token)
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            if request.logprobs is not None:
                request.logprobs.append({token.token: token.logprob, **token.top})
            with self._timing("detokenizing"):
                reason = self._finish_reason(request, token.token)
                if reason is not None:
                    request.completion = self._completion(request, reason)
            if reason is not None:
                request.finish_time = time.monotonic()
                self.scheduler.finish(request)
            events.append(TokenEvent(request, token.token, reason))
        return events

    @staticmethod
    def _record_prompt_logprobs(chunks, prompt_logits: dict) -> None:
        """The logits after each token of a scored prompt chunk give the next prompt token's
        log-probability (kept by position: a recompute writes the same again)."""
        for chunk in chunks:
            logits = prompt_logits.get(id(chunk))
            if logits is None:
                continue
            request = chunk.request
            end = min(chunk.end, len(request.prompt) - 1)  # the last prompt token predicts the output
            targets = request.prompt[chunk.start + 1 : end + 1]
            top = request.params.prompt_logprobs
            entries, ranks = prompt_token_logprobs(logits[: len(targets)], targets, top)
            request.prompt_logprobs[chunk.start + 1 : end + 1] = entries
            request.prompt_ranks[chunk.start + 1 : end + 1] = ranks

    def _measure_prefill(self, chunks, seconds: float) -> None:
        """Describe each step for `hit_pad_seconds`, and keep the prefill-only ones to fit its
        cost model on (a step with decodes in it says little about prefill)."""
        ended = time.perf_counter()
        idle, self._last_step_ended = ended - seconds - self._last_step_ended, ended
        # a step right after the engine sat idle runs slower: in bench isolation's server a 0.34 s
        # prefill took 9 ms more after 50 ms idle, 26 ms after 100 ms, 29 ms after 300 ms (a hit's
        # 0.08 s step, 8-11 ms). Padded hits idle the engine, so the steps after them are slow;
        # without this term they inflated every predicted miss. 0 up to 20 ms idle, 1 from 100 ms.
        cold = min(max(idle - 0.02, 0.0), 0.08) / 0.08
        tokens = sum(chunk.end - chunk.start for chunk in chunks)
        # query position q attends to q + 1 keys, cached context included: a hit's suffix still
        # pays for attending over the prefix it did not compute
        pairs = sum((chunk.end * (chunk.end + 1) - chunk.start * (chunk.start + 1)) // 2 for chunk in chunks)
        prefill_only = all(chunk.end - chunk.start > 1 for chunk in chunks)
        self._last_step = (tokens, pairs, cold, seconds, prefill_only)
        if prefill_only:
            self._prefill_samples.append((tokens, pairs, cold, seconds))
            self._prefill_fit = None

    def prefill_seconds_per_token(self) -> float | None:
        """The median seconds per token of recent prefill-only steps (None before any): what a
        cached token saves, against which a router weighs restoring it from a tier."""
        samples = [seconds / tokens for tokens, _, _, seconds in list(self._prefill_samples) if tokens]
        return sorted(samples)[len(samples) // 2] if samples else None

    def hit_pad_seconds(self, saved_tokens: int) -> float:
        """How much longer the step just run would have taken had one of its requests computed the
        `saved_tokens` leading prompt tokens it found in the cache: the server holds a shared hit's
        first token that long, so that its TTFT is a miss's.

        A cost model, seconds = overhead + tokens x per_token + attention pairs x per_pair +
        cold x slowdown, fitted on recent prefill-only steps, predicts the step as a miss; what the
        step took is subtracted. So the miss is predicted under the step's own conditions (its
        batch, an idle engine before it) and the hit's own timing noise cancels. In a step with
        decodes, outside the model, the pad is the model's cost of the saved tokens alone.

        The fit minimises absolute, not squared, deviations. Other work on the machine slows some
        steps far beyond their usual time; a least-squares fit follows those means, and padded
        hits answered slower than typical misses (bench isolation, 256-token prefixes: AUC 0.39,
        hits ~50 ms behind misses). The L1 fit follows the medians."""
        if saved_tokens <= 0 or not self._prefill_samples:
            return 0.0
        if self._prefill_fit is None:
            self._prefill_fit = self._fit_prefill_cost()
        overhead, per_token, per_pair, per_cold = self._prefill_fit
        tokens, pairs, cold, seconds, prefill_only = self._last_step
        saved = saved_tokens * per_token + saved_tokens * (saved_tokens + 1) // 2 * per_pair
        if not prefill_only:
            return max(0.0, saved)
        missed = overhead + tokens * per_token + pairs * per_pair + cold * per_cold + saved
        # the pad runs from the step's end: this fit (a millisecond or two) is time a miss does not wait
        return max(0.0, missed - seconds - (time.perf_counter() - self._last_step_ended))

    def _fit_prefill_cost(self) -> list[float]:
        """[overhead, per token, per attention pair, per cold] in seconds, by iteratively reweighted least squares."""
        # [n, 4]: tokens, pairs, cold, seconds
        samples = torch.tensor(list(self._prefill_samples), dtype=torch.float64)
        if len({(tokens, pairs) for tokens, pairs, _, _ in self._prefill_samples}) < 2:  # one kind of step
            return [0.0, (samples[:, 3] / samples[:, 0]).median().item(), 0.0, 0.0]
        # with two kinds of step (a hit's and a miss's) the terms are not separable, and need not
        # be: lstsq's minimum-norm solution still fits both, and predicting one from the other holds
        features = torch.cat([torch.ones(len(samples), 1, dtype=torch.float64), samples[:, :3]], dim=1)
        scale = features.amax(dim=0).clamp(min=1)  # columns of one magnitude keep the solve well conditioned
        features, seconds = features / scale, samples[:, 3]
        # a step's weight halves every 16 newer steps: when other work on the machine starts or
        # stops, the fit follows within a few requests (with equal weights the whole window had
        # to turn over: bench isolation saw padded hits 15 trials behind a jump in miss times)
        recency = 0.5 ** (torch.arange(len(samples) - 1, -1, -1, dtype=torch.float64) / 16)
        # a faint ridge on the slopes makes the solve full rank: with two or three kinds of step the
        # plain problem has many exact solutions, and which one LAPACK returned varied run to run
        ridge = torch.cat([torch.zeros(3, 1, dtype=torch.float64), torch.eye(3, dtype=torch.float64)], dim=1) * 1e-4
        weights = recency
        for _ in range(20):  # minimising sum(v r^2 / |r|) is minimising sum(v |r|)
            rows = weights.sqrt()[:, None]
            system = torch.cat([features * rows, ridge])
            target = torch.cat([seconds[:, None] * rows, torch.zeros(3, 1, dtype=torch.float64)])
            coefficients = torch.linalg.lstsq(system, target).solution[:, 0]
            weights = recency / (seconds - features @ coefficients).abs().clamp(min=1e-4)
        return (coefficients / scale).tolist()

    # ---- faults --------------------------------------------------------------------------------
    def _forward_isolating_faults(self, chunks) -> tuple[list, ForwardOutput, list]:
        """One forward for all chunks; if it raises, each chunk again alone, so a fault fails only
        the requests whose chunk raises by itself. Returns (the chunks computed, their
        ForwardOutput, [(request, error)] of the failed)."""
        try:
            return chunks, self.runner.forward(chunks, self._scorers(chunks)), []
        except Exception as error:  # noqa: BLE001 - attributed below, or re-raised
            if len(chunks) == 1:
                return [], ForwardOutput(None, []), [(chunks[0].owner, error)]
            first_error = error
        kept, outputs, failed = [], [], []
        for chunk in chunks:
            try:
                outputs.append(self.runner.forward([chunk], self._scorers([chunk])))
                kept.append(chunk)
            except Exception as error:  # noqa: BLE001
                failed.append((chunk.owner, error))
        if not kept:
            raise first_error  # not one request's fault: the engine itself is broken
        log.warning("a step failed; %d of %d chunks failed again alone and were cancelled", len(failed), len(chunks))
        logits = torch.cat([output.logits for output in outputs])
        compactions = [c for output in outputs for c in output.compactions]
        prompt_logits = {key: value for output in outputs for key, value in output.prompt_logits.items()}
        return kept, ForwardOutput(logits, compactions, prompt_logits), failed

    def _scorers(self, chunks) -> list:
        """What scores after each layer in a forward of `chunks`: planned compactions and the
        reconstruction passes whose chunks run."""
        # a chunk computed again after a failed batch scores the same again: the highest is kept
        passes = [chunk.reconstruction for chunk in chunks if isinstance(chunk, PassChunk)]
        return self.kv.plan_compactions(chunks) + passes

    def _sample_isolating_faults(self, logits, finishing, failed) -> list:
        """One SampledToken per finishing chunk, or None where sampling that row raised."""
        if not finishing:
            return []
        params, generators = [c.request.params for c in finishing], [c.request.generator for c in finishing]
        histories = [(c.request.prompt, c.request.output) for c in finishing]
        try:
            return sample(logits, params, generators, histories)
        except Exception:  # noqa: BLE001 - row by row, to find whose row it was
            tokens = []
            for row, chunk in enumerate(finishing):
                try:
                    rows = slice(row, row + 1)
                    tokens.extend(sample(logits[rows], params[rows], generators[rows], histories[rows]))
                except Exception as error:  # noqa: BLE001
                    failed.append((chunk.request, error))
                    tokens.append(None)
            return tokens

    def _fail(self, request: Request, error: Exception) -> TokenEvent:
        """Cancel one request after an internal fault in its part of a step; the others go on."""
        log.error(
            "request %s failed inside a step: %s: %s", request.request_id, type(error).__name__, error, exc_info=error
        )
        self.scheduler.cancel(request)
        request.finish_time = time.monotonic()
        request.error = f"internal error while computing this request: {type(error).__name__}"
        request.completion = CompletionOutput(request.index, "", list(request.output), "error", request.logprobs)
        return TokenEvent(request, -1, "error")

    def _finish_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if params.stops_at(token, self.eos):
            return "stop"
        if params.stop and self.tokenizer is not None:
            if request.stop_text is None:  # decodes only the newest tokens: linear in the output
                request.stop_text = IncrementalText(self.tokenizer, params.stop, self.eos, params.stop_token_ids)
            request.stop_text.add(token, final=False)
            if request.stop_text.stopped:
                return "stop"
        return "length" if len(request.output) >= params.max_tokens else None

    def _completion(self, request: Request, reason: str) -> CompletionOutput:
        token_ids = list(request.output)
        if (
            reason == "stop"
            and token_ids
            and (token_ids[-1] == self.eos or token_ids[-1] in request.params.stop_token_ids)
        ):
            token_ids = token_ids[:-1]
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        if reason == "stop" and request.params.stop:
            cut = find_stop(text, request.params.stop)
            text = text if cut is None else text[:cut]
        return CompletionOutput(
            request.index, text, token_ids, reason, request.logprobs, request.prompt_logprobs, request.prompt_ranks
        )
