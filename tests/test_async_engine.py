"""AsyncEngine's admission control, without HTTP: what counts against --max-queue."""

from __future__ import annotations

import pytest

from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.request import Request
from kvwise.server.async_engine import AsyncEngine
from kvwise.server.protocol import OpenAIError


def test_preempted_requests_do_not_fill_the_queue(llama):
    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=32))
    engine = AsyncEngine(core, max_queue=2)
    for _ in range(3):  # requests the engine took on and then preempted under memory pressure
        request = Request([1, 2, 3])
        request.preemptions = 1
        core.scheduler.waiting.append(request)
    engine.submit([Request([4, 5, 6]), Request([7, 8])])  # room for two new ones
    assert engine.queue_depth == 2
    with pytest.raises(OpenAIError) as refused:
        engine.submit([Request([9])])
    assert refused.value.status == 429
