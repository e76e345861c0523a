"""`AdaptiveController`: picks each request's KV mix at admission and relieves memory pressure.

At admission (the scheduler asks it before the request's prefix is matched), a request that asked
for `auto` gets, for its class (`request_class`):
- an operator's pinned mix for that class, if any;
- `full` when its prompt is short (nothing worth saving) or memory is to spare: the ladder is down
  and its whole KV (prompt and output) fits the pool's free blocks now;
- for a request whose prompt opens with a document (`compress_upto`), a form per document, by how
  often it is expected to be asked about again (`document_reuse`: its own repeats, or the tenant's
  mean repeats per document): full while it is held in full or the misses it would spare do not
  pay for compressing it, else the cheapest evicting mix meeting the floor, compressed once and
  reused by every later request for it;
- otherwise the cheapest mix, in bytes, whose profiled quality meets the floor (`Profile.cheapest`),
  among the quantizers the server allows, and, when the pool cannot lend a context pass right now,
  among the mixes that need none.

Under pressure (memory held a request back in the last `steps_per_rung` steps: a prefill chunk found
no blocks, or a running request was swapped out or preempted) it climbs a ladder, one rung every
`steps_per_rung` steps, and comes down the same way once usage is under the low watermark with nobody
held back (between the two, it holds: the hysteresis). A pool that is nearly full but holds all its
work is not pressure: compressing then would cost quality for nothing.
1. quantize: the longest tolerant running request (one whose class keeps the floor under a
   quantizer alone, whose quantizer's measured error is in bounds) stores its settled blocks
   quantized;
2. compress: the longest tolerant running request with no eviction yet (a quality-meeting mix with
   no context pass exists for its class, its prefix hit rate is low, and any earlier eviction kept
   most of the policy's score) gets that mix's keep fraction as a cap, evicted on its next step;
3. spill: cold prefix-cache blocks leave the device (to the tiers, when there are any).
Swapping out and preempting stay the scheduler's last resort; the controller counts them.

With the machine's costs (`Profile.costs`, measured by `kvwise calibrate`; `costs.CostModel`),
every choice and rung action above is first weighed: the output tokens it gains by letting
held-back requests run now, against those its seconds cost (a quantization, a context pass, a
slower decode step). One that does not pay is not taken, and a step where nothing pays is counted
as `hold: no action pays`: on a machine where memory does not hold throughput back, `auto` leaves
the KV as it is. The model corrects itself online on the engine's decode-only steps. Without
measured costs the controller acts on quality and bytes alone.

Only requests that asked for `auto` are touched: an explicit policy always wins.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

from kvwise.adaptive.costs import CostModel, Holder, Verdict
from kvwise.adaptive.decisions import Choice, Decisions
from kvwise.adaptive.document_reuse import DocumentReuse, worth_compressing
from kvwise.adaptive.profile import MixProfile, Profile, check_class
from kvwise.adaptive.request_class import check_hint, classify
from kvwise.engine.kv_actions import Action, AssignMix, SpillPrefixes
from kvwise.engine.kv_view import ControllerView, RunningRequest
from kvwise.engine.request import Request
from kvwise.policies.mix import Mix, parse_mix
from kvwise.policies.registry import make_policy

log = logging.getLogger("kvwise.adaptive")


@dataclass
class AdaptiveConfig:
    quality: float = 0.98  # floor on predicted quality relative to the full cache, per class
    allowed_quants: tuple[str, ...] | None = None  # quantizer names auto may pick (None: every one)
    class_mix: dict[str, str] = field(default_factory=dict)  # class -> a pinned mix
    low_watermark: float = 0.70  # usage under which (nobody held back) it de-escalates
    steps_per_rung: int = 4  # steps between two moves on the ladder: an action takes a step to show
    min_prompt_tokens: int = 256  # shorter prompts keep everything: there is little to save
    min_kept_score: float = 0.6  # a request whose eviction kept less of its policy's score is left alone
    max_prefix_hit_rate: float = 0.5  # a request mostly served by shared blocks has little to compress
    max_quant_error: float = 0.35  # a quantizer whose measured mean relative error exceeds this is skipped

    def __post_init__(self):
        if not 0 < self.quality <= 1:
            raise ValueError(f"the quality floor must be in (0, 1], got {self.quality}")
        if not 0 < self.low_watermark < 1:
            raise ValueError(f"the low watermark must be in (0, 1), got {self.low_watermark}")
        self.class_mix = {check_class(klass): parse_mix(mix).spec for klass, mix in self.class_mix.items()}
        if self.allowed_quants is not None:
            self.allowed_quants = tuple(name.split(":")[0] for name in self.allowed_quants)


class AdaptiveController:
    """The engine's KV controller (`EngineCore.attach_controller`): `admit(request, view)` and
    `before_step(view)` read a `ControllerView` and answer with actions the manager carries out."""

    RUNGS = ("quantize", "compress", "spill")

    def __init__(self, profile: Profile, config: AdaptiveConfig | None = None, costs: CostModel | None = None):
        """costs: what actions cost on this machine (default: the profile's measured costs, if any)."""
        self.profile, self.config = profile, config or AdaptiveConfig()
        if costs is None and profile.costs is not None:
            costs = CostModel(profile.costs)
        self.costs = costs
        self.decisions = Decisions()
        self.documents = DocumentReuse()  # per document: how often asked about, and its chosen form
        self.level = 0  # rungs in force (0: none)
        self._steps_since_move = 0
        self._rung_actions = (self._quantize, self._compress, self._spill)  # in the order of RUNGS
        self._pending: dict[Request, tuple[str, int]] = {}  # capped request -> (action, bytes before)
        self._refused: weakref.WeakSet[Request] = weakref.WeakSet()  # requests whose quantization failed
        self._seen = {"swapped": 0, "recomputed": 0, "held": 0}  # the engine's counts when last read
        self._steps = 0
        self._promised = 0  # blocks the requests admitted since the last step will take at full size
        self._last_held_back = None  # the step memory last held a request back
        self._unpaid = 0  # rung actions weighed and not taken in this step

    @staticmethod
    def check_hint(hint: str) -> None:
        """ValueError for a class hint the controller does not know (the engine asks, per request)."""
        check_hint(hint)

    # ---- admission -----------------------------------------------------------------------------
    def admit(self, request: Request, view: ControllerView) -> AssignMix | None:
        """Choose once: a preempted request keeps its mix when it comes back."""
        if request.kv_auto is None or request.kv is not None or request.kv_choice is not None:
            return None
        choice = self.choose(request, view)
        self.decisions.record_choice(request.request_id, choice)
        return AssignMix(request, choice.mix, label=choice, reason=choice.reason)

    def choose(self, request: Request, view: ControllerView) -> Choice:
        klass = classify(
            len(request.prompt),
            request.params.max_tokens,
            request.kv_auto,
            compresses_document=request.compress_upto is not None,
            turns=request.turns,
        )
        pinned = self.config.class_mix.get(klass)
        if pinned is not None:
            entry = self.profile.get(pinned)
            return Choice(pinned, klass, "pinned", entry.quality[klass] if entry else None)
        if len(request.prompt) < self.config.min_prompt_tokens:
            return Choice("full", klass, "short", 1.0)
        if request.compress_upto is not None:
            return self._choose_document(request, klass, view)
        whole = _blocks(len(request.prompt) + request.params.max_tokens, view)
        if self.level == 0 and self._promised + whole <= view.free_blocks:
            # its whole KV fits the free blocks now, beside what this step's admissions were
            # promised; neither the queue nor running requests' growth counts: the queue is admitted
            # as memory frees, growth is met by the ladder, and compressing ahead of a need that may
            # not come costs time and quality now
            self._promised += whole
            return Choice("full", klass, "spare", 1.0)
        # a KVzip pass needs room for the prompt again now; one that cannot borrow its blocks
        # sends the request back to be computed again
        pass_fits = self._pass_fits(request, view)
        entry = self.profile.cheapest(
            klass, self.config.quality, lambda e: self._allowed(e) and (pass_fits or not _needs_pass(e.mix))
        )
        if entry.mix != "full" and not self._admission_pays(request, entry, view).pays:
            return Choice("full", klass, NO_GAIN, 1.0)
        return Choice(entry.mix, klass, "pressure", entry.quality[klass])

    def _choose_document(self, request: Request, klass: str, view: ControllerView) -> Choice:
        """A document's form, by how often it is expected to be asked about again (its own repeats,
        or the tenant's mean): full while that is too little or it is held in full (a prefix-cache
        hit costs least), compressed once (the cheapest evicting mix meeting the floor) when the
        misses that spares pay for compressing it; then that mix, every time."""
        upto = request.compress_upto
        record = self.documents.sight(request.tenant, request.prompt[:upto])
        if record.mix is not None:  # the same mix finds the compressed copy (its key holds the mix)
            entry = self.profile.get(record.mix)
            return Choice(record.mix, klass, DOCUMENT_COMPRESSED, entry.quality[klass] if entry else None)
        if view.document_cached_tokens + view.block_size > upto:  # all but a partial last block
            return Choice("full", klass, DOCUMENT_CACHED, 1.0)
        pass_fits = self._pass_fits(request, view)
        entry = self.profile.cheapest(
            klass,
            self.config.quality,
            lambda e: parse_mix(e.mix).evicts and self._allowed(e) and (pass_fits or not _needs_pass(e.mix)),
        )
        prefill = self.costs.costs.prefill_seconds_per_token if self.costs is not None else None
        if entry.mix == "full" or not worth_compressing(record.expected_reuse, prefill, entry.extra_seconds_per_token):
            return Choice("full", klass, DOCUMENT_NEW, 1.0)
        record.mix = entry.mix
        return Choice(entry.mix, klass, DOCUMENT_REUSED, entry.quality[klass])

    def _pass_fits(self, request: Request, view: ControllerView) -> bool:
        """Whether a KVzip pass over `request` could borrow its blocks now: it needs room for the
        prompt again, beside what this step's admissions were promised."""
        free_tokens = (view.free_blocks - self._promised) * view.block_size
        return free_tokens >= 2 * (len(request.prompt) + view.block_size)

    def _admission_pays(self, request: Request, entry: MixProfile, view: ControllerView) -> Verdict:
        """Whether running `request` with `entry` now, rather than in full once memory frees, gains
        more tokens than the mix costs (always, without measured costs)."""
        if self.costs is None:
            return Verdict(1.0, 0.0)
        token_bytes = view.block_bytes / view.block_size
        whole = len(request.prompt) + request.params.max_tokens
        held, prompt_bytes = _holders(view), len(request.prompt) * token_bytes
        free = (view.free_blocks - self._promised) * view.block_bytes
        needs = entry.bytes_fraction * whole * token_bytes
        if needs > free:
            return Verdict(0.0, 0.0)  # it waits either way
        if whole * token_bytes <= free:  # it could run in full now (the ladder is up)
            now = held + [Holder("full", round(prompt_bytes))]
            now += _admit(view.held_back_tokens, free - whole * token_bytes, token_bytes)
            # the gain goes to the first held-back request
            wait = _wait_steps(view, min(view.held_back_tokens, default=0) * token_bytes, free - whole * token_bytes)
        else:  # in full it waits for memory: the gain goes to this one
            now = held + _admit(view.held_back_tokens, free, token_bytes)
            wait = _wait_steps(view, whole * token_bytes, free)
        joining = Holder(_form(entry.mix), round(entry.bytes_fraction * prompt_bytes))
        after = held + [joining] + _admit(view.held_back_tokens, free - needs, token_bytes)
        one_time = entry.extra_seconds_per_token * len(request.prompt)
        tail = self._slowdown(Holder("full", round(prompt_bytes)), joining) * max(0, request.params.max_tokens - wait)
        return self.costs.verdict(now, after, [], one_time, wait, tail)

    def _allowed(self, entry: MixProfile) -> bool:
        quant = entry.quant
        if quant is None or self.config.allowed_quants is None:
            return True
        return quant.split(":")[0] in self.config.allowed_quants

    # ---- pressure ------------------------------------------------------------------------------
    def before_step(self, view: ControllerView) -> list[Action]:
        """Before the engine schedules a step: log what the last actions did, count the
        scheduler's swaps and preemptions, move on the ladder, and answer with this step's actions
        (at most one per rung in force)."""
        self._promised = 0  # admissions of the last step hold their blocks by now
        self._observe(view)
        self._read_outcomes(view)
        self._settle_pending(view)
        self._count_scheduler_actions(view)
        usage, held_back = self.pressure(view)
        self._steps += 1
        self._steps_since_move += 1
        if held_back:
            self._last_held_back = self._steps
        recently = self._last_held_back is not None and self._steps - self._last_held_back < self.config.steps_per_rung
        if self._steps_since_move >= self.config.steps_per_rung:
            if recently and self.level < len(self.RUNGS):
                self.level += 1
                self._steps_since_move = 0
            elif usage < self.config.low_watermark and not recently and self.level > 0:
                self.level -= 1
                self._steps_since_move = 0
        if self.level == 0 or usage < self.config.low_watermark:
            return []
        reason, actions = ("held back" if recently else "holding"), []
        self._unpaid = 0
        for act in self._rung_actions[: self.level]:
            action = act(view, reason, {a.request for a in actions if isinstance(a, AssignMix)})
            if action is not None:
                actions.append(action)
        if self._unpaid and not any(isinstance(a, AssignMix) for a in actions):
            self.decisions.record("hold", NO_GAIN, detail=f"{self._unpaid} candidate actions weighed")
        return actions

    def _observe(self, view: ControllerView) -> None:
        """Correct the cost model with the last step, when it decoded the requests running now."""
        step = view.last_step
        if self.costs is None or step is None or not step.decode_only:
            return
        decoding = _holders(view)
        if decoding and len(decoding) == step.decodes:
            self.costs.observe(decoding, step.seconds)

    def _running_pays(self, view: ControllerView, running: RunningRequest, entry: MixProfile, kept: float) -> bool:
        """Whether moving `running` to `entry`'s form, keeping `kept` of its bytes, gains more
        tokens (held-back requests admitted with the bytes it frees) than it costs; counts a no."""
        if self.costs is None:
            return True
        token_bytes = view.block_bytes / view.block_size
        held = _holders(view)
        free = view.free_blocks * view.block_bytes
        freed = running.held_bytes * (1 - kept)
        now = held + _admit(view.held_back_tokens, free, token_bytes)
        after = [
            Holder(_form(entry.mix), round(r.held_bytes * kept)) if r.request is running.request else holder
            for r, holder in zip(_decoding(view), held)
        ]
        admitted = _admit(view.held_back_tokens, free + freed, token_bytes)
        one_time = entry.extra_seconds_per_token * running.tokens
        first_need = min(view.held_back_tokens, default=0) * token_bytes
        wait = _wait_steps(view, first_need, free)
        changed = Holder(_form(entry.mix), round(running.held_bytes * kept))
        tail = self._slowdown(Holder(running.kv_form, running.held_bytes), changed)
        tail *= max(0, running.remaining_tokens - wait)
        if self.costs.verdict(now, after, admitted, one_time, wait, tail).pays:
            return True
        self._unpaid += 1
        return False

    def _slowdown(self, before: Holder, after: Holder) -> float:
        """Seconds a decode step gains when one request goes from `before` to `after` (>= 0)."""
        return max(0.0, self.costs.step_seconds([after]) - self.costs.step_seconds([before]))

    def pressure(self, view: ControllerView) -> tuple[float, bool]:
        """(the pool's usage in [0, 1], whether memory held a request back since the last step:
        a prefill chunk found no blocks, or a running request was swapped out or preempted)."""
        held = view.memory_stalls + view.preemptions
        held_back, self._seen["held"] = held > self._seen["held"], held
        return view.usage, held_back

    def _candidates(self, view: ControllerView, taken: set) -> list[RunningRequest]:
        """Running auto requests past their prefill (not pinned, not `taken`), longest first."""
        running = [
            r
            for r in view.running
            if r.kv_auto is not None
            and r.past_prefill
            and (r.kv_choice is None or r.kv_choice.reason != "pinned")
            and r.request not in taken
        ]
        return sorted(running, key=lambda r: r.tokens, reverse=True)

    @staticmethod
    def _klass(running: RunningRequest) -> str:
        return running.kv_choice.klass if running.kv_choice is not None else "chat"

    def _quantize(self, view: ControllerView, reason: str, taken: set) -> AssignMix | None:
        """taken: requests an earlier rung acts on in this step."""
        for running in self._candidates(view, taken):
            if running.has_settings or running.request in self._refused:
                continue
            klass = self._klass(running)
            entry = self._best_quant_only(klass, view.quantization_errors)
            if entry is None or not self._running_pays(view, running, entry, entry.bytes_fraction):
                continue
            label = Choice(entry.mix, klass, "pressure", entry.quality[klass])
            return AssignMix(running.request, entry.mix, label, quantize_now=True, kind="quantize", reason=reason)
        return None

    def _best_quant_only(self, klass: str, errors: dict) -> MixProfile | None:
        def tolerable(entry: MixProfile) -> bool:
            mix = parse_mix(entry.mix)
            if mix.evicts or mix.quant is None or not self._allowed(entry):
                return False
            error = errors.get(mix.quant)
            return error is None or max(error) <= self.config.max_quant_error

        choices = [e for e in self.profile.mixes if tolerable(e) and e.quality[klass] >= self.config.quality]
        return min(choices, key=lambda e: e.bytes_fraction, default=None)

    def _compress(self, view: ControllerView, reason: str, taken: set) -> AssignMix | None:
        for running in self._candidates(view, taken):
            if running.evicts or running.quantized:
                continue  # evicting already, or quantized blocks an eviction cannot read back
            if running.reused > self.config.max_prefix_hit_rate * running.prompt_tokens:
                continue
            if running.kept_score is not None and running.kept_score < self.config.min_kept_score:
                continue
            klass = self._klass(running)
            entry = self._best_evicting(klass)
            private = running.tokens - running.reused
            if entry is None or private < self.config.min_prompt_tokens:
                continue
            mix = parse_mix(entry.mix)
            if not self._running_pays(view, running, entry, 1 - mix.ratio * private / running.tokens):
                continue
            cap = max(view.block_size, round((1 - mix.ratio) * private))
            capped = Mix(mix.policy, max_tokens=cap, options=mix.options)
            label = Choice(capped.spec, klass, "pressure", entry.quality[klass])
            return AssignMix(running.request, capped.spec, label, kind="compress", reason=reason)
        return None

    def _best_evicting(self, klass: str) -> MixProfile | None:
        def fits(entry: MixProfile) -> bool:
            mix = parse_mix(entry.mix)
            return mix.evicts and mix.quant is None and not _needs_pass(entry.mix)

        choices = [e for e in self.profile.mixes if fits(e) and e.quality[klass] >= self.config.quality]
        return min(choices, key=lambda e: e.bytes_fraction, default=None)

    def _spill(self, view: ControllerView, reason: str, taken: set) -> SpillPrefixes | None:
        if self.costs is not None:
            # the pool counts prefix blocks nobody holds as free already (it reclaims them when
            # asked): a spill frees nothing a held-back request could use, and without tiers it
            # drops prefixes a next turn would reuse, so it never pays
            self._unpaid += 1
            return None
        return SpillPrefixes(max(1, view.num_blocks // 16), reason=reason)

    def _read_outcomes(self, view: ControllerView) -> None:
        """Log what the actions answered last step did."""
        for outcome in view.outcomes:
            action = outcome.action
            if isinstance(action, SpillPrefixes):
                if outcome.freed_bytes:
                    where = "tiers" if view.has_tiers else "dropped"
                    self.decisions.record("spill", action.reason, "", outcome.freed_bytes, where)
                continue
            request_id = action.request.request_id
            if outcome.error is not None:
                self._refused.add(action.request)
                log.info("kv auto: %s of %s failed: %s", action.kind, request_id, outcome.error)
            elif action.kind == "quantize":
                self.decisions.record("quantize", action.reason, request_id, outcome.freed_bytes, action.mix)
            elif action.kind == "compress":
                self._pending[action.request] = ("compress", outcome.bytes_before)
                self.decisions.record("compress", action.reason, request_id, 0, action.mix)

    def _settle_pending(self, view: ControllerView) -> None:
        """Bytes a cap freed, once its eviction ran (the request holds a region then)."""
        running = {r.request: r for r in view.running}
        for request, (action, before) in list(self._pending.items()):
            now = running.get(request)
            if now is None or now.has_region:  # finished (or gone), or its eviction ran
                del self._pending[request]
                if now is not None:
                    self.decisions.bytes_freed[action] += max(0, before - now.held_bytes)

    def _count_scheduler_actions(self, view: ControllerView) -> None:
        swapped, recomputed = view.swapped_out_blocks, view.recomputed_blocks
        if swapped > self._seen["swapped"]:
            freed = (swapped - self._seen["swapped"]) * view.block_bytes
            self.decisions.record("swap", "no blocks", freed=freed)
        if recomputed > self._seen["recomputed"]:
            freed = (recomputed - self._seen["recomputed"]) * view.block_bytes
            self.decisions.record("preempt", "no blocks", freed=freed)
        self._seen.update(swapped=swapped, recomputed=recomputed)


NO_GAIN = "no action pays"
DOCUMENT_NEW = "document: too little reuse expected"
DOCUMENT_CACHED = "document: held in full"
DOCUMENT_REUSED = "document: reuse pays, compressed once"
DOCUMENT_COMPRESSED = "document: compressed already"


def _decoding(view: ControllerView) -> list[RunningRequest]:
    return [r for r in view.running if r.past_prefill]


def _holders(view: ControllerView) -> list[Holder]:
    """The decoding requests, as the cost model sees them."""
    return [Holder(r.kv_form, r.held_bytes) for r in _decoding(view)]


def _admit(held_back_tokens: tuple[int, ...], free_bytes: float, token_bytes: float) -> list[Holder]:
    """The held-back requests that `free_bytes` lets run, smallest first, in full."""
    admitted = []
    for tokens in sorted(held_back_tokens):
        need = tokens * token_bytes
        if need > free_bytes:
            break
        free_bytes -= need
        admitted.append(Holder("full", round(need)))
    return admitted


def _wait_steps(view: ControllerView, need_bytes: float, free_bytes: float) -> float:
    """Steps until memory frees `need_bytes` by itself: running requests end, soonest first, and
    give their bytes back; the held-back request would then run without any action."""
    if need_bytes <= free_bytes:
        return 0.0
    for running in sorted(_decoding(view), key=lambda r: r.remaining_tokens):
        free_bytes += running.held_bytes
        if free_bytes >= need_bytes:
            return float(running.remaining_tokens)
    return float(max((r.remaining_tokens for r in view.running), default=0))


def _form(mix: str) -> str:
    """The cost model's form of a mix: its quantizer's name, `evicted`, or `full`."""
    parsed = parse_mix(mix)
    if parsed.quant is not None:
        return parsed.quant.split(":")[0]
    return "evicted" if parsed.evicts else "full"


def _blocks(tokens: int, view: ControllerView) -> int:
    return -(-tokens // view.block_size)


def _needs_pass(mix: str) -> bool:
    """Whether the mix's policy scores with a second pass over the context (KVzip)."""
    parsed = parse_mix(mix)
    return parsed.evicts and make_policy(parsed.policy).needs_context_pass
