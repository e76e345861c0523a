"""The server's log lines about its work: a periodic stats line, and one line per finished request
when asked (`--log-requests`), without prompt or output text unless asked (`--log-request-text`)."""

from __future__ import annotations

import logging
import time

from kvwise.engine.core import EngineCore
from kvwise.engine.request import Request
from kvwise.server.metrics import ServerMetrics

log = logging.getLogger("kvwise.server")


class StatsLog:
    """interval_seconds: between two stats lines (0: none); a line is written only after a period
    with work in it, so an idle server stays quiet. The token counts are the metrics' (one owner)."""

    def __init__(self, core: EngineCore, interval_seconds: float = 10.0, requests: bool = False, text: bool = False):
        if interval_seconds < 0:
            raise ValueError(f"--log-stats-interval must be >= 0, got {interval_seconds}")
        self.core, self.interval, self.requests, self.text = core, interval_seconds, requests, text
        self._since, self._totals = time.monotonic(), (0, 0, 0)  # (prompt, hit, generated) tokens then

    def maybe_log(self, metrics: ServerMetrics) -> None:
        now = time.monotonic()
        if not self.interval or now - self._since < self.interval:
            return
        totals = (metrics.prompt_total, metrics.hit_total, metrics.generated_total)
        prompt, hits, generated = (new - old for new, old in zip(totals, self._totals))
        scheduler, elapsed = self.core.scheduler, now - self._since
        if prompt or generated or scheduler.running or scheduler.waiting:
            log.info(
                "engine: prompt %.1f tok/s, generation %.1f tok/s, %d running, %d waiting, KV usage %.1f%%, "
                "prefix hit rate %.1f%%",
                prompt / elapsed,
                generated / elapsed,
                len(scheduler.running),
                len(scheduler.waiting),
                100 * self.core.kv.stats().block_usage,
                100 * hits / prompt if prompt else 0.0,
            )
        self._since, self._totals = now, totals

    def finished(self, request: Request, outcome: str) -> None:
        if not self.requests:
            return
        now = time.monotonic()
        ttft = f"{request.first_token_time - request.arrival:.3f}s" if request.first_token_time else "-"
        line = (
            f"request {request.request_id} tenant={request.tenant} outcome={outcome} "
            f"prompt_tokens={len(request.prompt)} cached_tokens={request.reused} output_tokens={len(request.output)} "
            f"ttft={ttft} e2e={(request.finish_time or now) - request.arrival:.3f}s"
        )
        if self.text and self.core.tokenizer is not None:
            prompt = self.core.tokenizer.decode(request.prompt)
            output = self.core.tokenizer.decode(request.output)
            line += f" prompt={prompt!r} output={output!r}"
        log.info("%s", line)
