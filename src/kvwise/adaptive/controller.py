"""`AdaptiveController`: picks each request's KV mix at admission and relieves memory pressure.

At admission (the scheduler asks it before the request's prefix is matched), a request that asked
for `auto` gets, for its class (`request_class`):
- an operator's pinned mix for that class, if any;
- `full` when its prompt is short (nothing worth saving) or memory is to spare: the ladder is down
  and its whole KV (prompt and output) fits the pool's free blocks now;
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

Only requests that asked for `auto` are touched: an explicit policy always wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvwise.adaptive.decisions import Choice, Decisions
from kvwise.adaptive.profile import MixProfile, Profile, check_class
from kvwise.adaptive.request_class import check_hint, classify
from kvwise.engine.block_table import Place
from kvwise.engine.kv_settings import resolve
from kvwise.engine.request import Request
from kvwise.policies.mix import Mix, parse_mix
from kvwise.policies.registry import make_policy


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
    RUNGS = ("quantize", "compress", "spill")

    def __init__(self, profile: Profile, config: AdaptiveConfig | None = None):
        self.profile, self.config = profile, config or AdaptiveConfig()
        self.decisions = Decisions()
        self.level = 0  # rungs in force (0: none)
        self.engine = None
        self._steps_since_move = 0
        self._rung_actions = (self._quantize, self._compress, self._spill)  # in the order of RUNGS
        self._pending: dict[Request, tuple[str, int]] = {}  # request -> (action, bytes before)
        self._seen = {"swapped": 0, "recomputed": 0, "held": 0}  # the engine's counts when last read
        self._steps = 0
        self._promised = 0  # blocks the requests admitted since the last step will take at full size
        self._last_held_back = None  # the step memory last held a request back

    def attach(self, engine) -> None:
        """Serve `engine` (an EngineCore): its scheduler asks before each admission."""
        self.engine = engine
        engine.scheduler.on_admitting.append(self.admit)

    @staticmethod
    def check_hint(hint: str) -> None:
        """ValueError for a class hint the controller does not know (the engine asks, per request)."""
        check_hint(hint)

    # ---- admission -----------------------------------------------------------------------------
    def admit(self, request) -> None:
        """Choose once: a preempted request keeps its mix when it comes back."""
        if request.kv_auto is None or request.kv is not None or request.kv_choice is not None:
            return
        choice = self.choose(request)
        request.kv_choice = choice
        if choice.mix != "full":
            self.engine.kv.assign_settings(request, resolve(choice.mix))
        self.decisions.record_choice(request.request_id, choice)

    def choose(self, request) -> Choice:
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
        if self.level == 0 and self._memory_to_spare(request):
            self._promised += self._blocks(len(request.prompt) + request.params.max_tokens)
            return Choice("full", klass, "spare", 1.0)
        pass_fits = self._pass_fits(request)
        entry = self.profile.cheapest(
            klass, self.config.quality, lambda e: self._allowed(e) and (pass_fits or not _needs_pass(e.mix))
        )
        if request.compress_upto is not None and not parse_mix(entry.mix).evicts:
            # a document compressed once needs an evicting mix; else keep it whole
            entry = self.profile.get("full")
        return Choice(entry.mix, klass, "pressure", entry.quality[klass])

    def _pass_fits(self, request) -> bool:
        """Whether the pool has room now for a context pass (KVzip's) over this request's prompt as
        well as the prompt: under pressure it usually does not, and a pass that cannot borrow its
        blocks sends the request back to be computed again."""
        free = self.engine.kv.free_blocks() - self._promised
        return free * self.engine.kv.block_size >= 2 * (len(request.prompt) + self.engine.kv.block_size)

    def _allowed(self, entry: MixProfile) -> bool:
        quant = entry.quant
        if quant is None or self.config.allowed_quants is None:
            return True
        return quant.split(":")[0] in self.config.allowed_quants

    def _memory_to_spare(self, request) -> bool:
        """This request's full KV (prompt and output) fits the pool's free blocks now (prefix-cache
        blocks nobody holds count as free), beside what the requests admitted since the last step
        were promised (their blocks are taken only when their chunks are scheduled). Neither the
        queue nor running requests' future growth is counted: the queue is admitted as memory frees
        and growth is met by the ladder, while compressing ahead of a need that may not come costs
        time and quality now."""
        own = self._blocks(len(request.prompt) + request.params.max_tokens)
        return self._promised + own <= self.engine.kv.free_blocks()

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.engine.kv.block_size)

    # ---- pressure ------------------------------------------------------------------------------
    def before_step(self) -> None:
        """Called by the engine before it schedules a step: settle what the last actions freed,
        count the scheduler's swaps and preemptions, move on the ladder, act."""
        self._promised = 0  # admissions of the last step hold their blocks by now
        self._settle_pending()
        self._count_scheduler_actions()
        usage, held_back = self.pressure()
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
            return
        reason = "held back" if recently else "holding"
        for act in self._rung_actions[: self.level]:
            act(reason)

    def pressure(self) -> tuple[float, bool]:
        """(the pool's usage in [0, 1], whether memory held a request back since the last step:
        a prefill chunk found no blocks, or a running request was swapped out or preempted)."""
        scheduler, kv = self.engine.scheduler, self.engine.kv
        held = scheduler.memory_stalls + scheduler.preemptions
        held_back, self._seen["held"] = held > self._seen["held"], held
        return kv.usage(), held_back

    def _candidates(self):
        """Running auto requests past their prefill (not pinned), longest first."""
        running = [
            r
            for r in self.engine.scheduler.running
            if r.kv_auto is not None
            and not r.prefilling
            and r.reconstruction is None
            and (r.kv_choice is None or r.kv_choice.reason != "pinned")
        ]
        return sorted(running, key=lambda r: len(r.tokens), reverse=True)

    def _klass(self, request) -> str:
        return request.kv_choice.klass if request.kv_choice is not None else "chat"

    def _quantize(self, reason: str) -> bool:
        errors = self.engine.kv.stats().quantization_errors
        for request in self._candidates():
            if request.kv is not None:
                continue
            entry = self._best_quant_only(self._klass(request), errors)
            if entry is None:
                continue
            kv = self.engine.kv
            before, previous = kv.request_bytes(request), request.kv_choice
            kv.assign_settings(request, resolve(entry.mix))
            request.kv_choice = Choice(entry.mix, self._klass(request), "pressure", entry.quality[self._klass(request)])
            failed = kv.quantize_settled([request])
            if failed:  # that request keeps its blocks as they were
                kv.assign_settings(request, None)
                request.kv_choice = previous
                continue
            self.decisions.record("quantize", reason, request.request_id, before - kv.request_bytes(request), entry.mix)
            return True
        return False

    def _best_quant_only(self, klass: str, errors: dict) -> MixProfile | None:
        def tolerable(entry: MixProfile) -> bool:
            mix = parse_mix(entry.mix)
            if mix.evicts or mix.quant is None or not self._allowed(entry):
                return False
            error = errors.get(mix.quant)
            return error is None or max(error) <= self.config.max_quant_error

        choices = [e for e in self.profile.mixes if tolerable(e) and e.quality[klass] >= self.config.quality]
        return min(choices, key=lambda e: e.bytes_fraction, default=None)

    def _compress(self, reason: str) -> bool:
        kv = self.engine.kv
        for request in self._candidates():
            if request.kv is not None and (request.kv.evicts or request.kv.quant is not None):
                continue  # evicting already, or quantized blocks an eviction cannot read back
            if Place.QUANTIZED in request.blocks.places:
                continue
            if request.reused > self.config.max_prefix_hit_rate * len(request.prompt):
                continue
            kept = getattr(request, "kept_score", None)
            if kept is not None and kept < self.config.min_kept_score:
                continue
            klass = self._klass(request)
            entry = self._best_evicting(klass)
            private = len(request.tokens) - request.reused
            if entry is None or private < self.config.min_prompt_tokens:
                continue
            mix = parse_mix(entry.mix)
            cap = max(kv.block_size, round((1 - mix.ratio) * private))
            capped = Mix(mix.policy, max_tokens=cap, options=mix.options)
            kv.assign_settings(request, resolve(capped))
            request.kv_choice = Choice(capped.spec, klass, "pressure", entry.quality[klass])
            self._pending[request] = ("compress", kv.request_bytes(request))
            self.decisions.record("compress", reason, request.request_id, 0, f"cap={cap} ({entry.mix})")
            return True
        return False

    def _best_evicting(self, klass: str) -> MixProfile | None:
        def fits(entry: MixProfile) -> bool:
            mix = parse_mix(entry.mix)
            return mix.evicts and mix.quant is None and not _needs_pass(entry.mix)

        choices = [e for e in self.profile.mixes if fits(e) and e.quality[klass] >= self.config.quality]
        return min(choices, key=lambda e: e.bytes_fraction, default=None)

    def _spill(self, reason: str) -> bool:
        kv = self.engine.kv
        evicted = kv.spill_cold_prefixes(max(1, kv.num_blocks // 16))
        if evicted:
            where = "tiers" if kv.has_tiers else "dropped"
            self.decisions.record("spill", reason, "", evicted * kv.block_bytes, where)
        return bool(evicted)

    def _settle_pending(self) -> None:
        """Bytes a cap freed, once its eviction ran (the request holds a region then)."""
        kv = self.engine.kv
        for request, (action, before) in list(self._pending.items()):
            if request.done or request.region is not None:
                del self._pending[request]
                if not request.done:
                    self.decisions.bytes_freed[action] += max(0, before - kv.request_bytes(request))

    def _count_scheduler_actions(self) -> None:
        kv = self.engine.kv  # two counters, read every step: not a whole stats() snapshot
        swapped, recomputed = kv.swapped_out_blocks, kv.recomputed_blocks
        if swapped > self._seen["swapped"]:
            self.decisions.record("swap", "no blocks", freed=(swapped - self._seen["swapped"]) * kv.block_bytes)
        if recomputed > self._seen["recomputed"]:
            self.decisions.record(
                "preempt", "no blocks", freed=(recomputed - self._seen["recomputed"]) * kv.block_bytes
            )
        self._seen.update(swapped=swapped, recomputed=recomputed)


def _needs_pass(mix: str) -> bool:
    """Whether the mix's policy scores with a second pass over the context (KVzip)."""
    parsed = parse_mix(mix)
    return parsed.evicts and make_policy(parsed.policy).needs_context_pass
