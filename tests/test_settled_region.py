"""A capped request with a quantizer holds its region in the stored form across compactions: a
quantized row keeps its codes (until its head's pages, left sparse by evictions, are repacked),
the newest tokens stay in the model's dtype (the residual window), and the pages hold at most
about twice the bytes of the rows they keep."""

from __future__ import annotations

import pytest
import torch

from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.sampling import SamplingParams
from kvwise.kv.quantizer import make_quantizer
from kvwise.kv.stored_form import StoredForm
from kvwise.policies.mix import Mix
from tests.conftest import VOCAB

pytestmark = pytest.mark.timeout(120)

CAP, PROMPT, NEW_TOKENS = 100, 150, 120


@pytest.mark.parametrize("quant", ["kivi4:residual_length=32:group_size=16", "int8"])
def test_a_capped_request_never_quantizes_a_row_twice(llama, quant):
    core = EngineCore(llama, None, CacheConfig(block_size=16, num_blocks=128, token_budget=64, prefix_caching=False))
    prompt = [3 + index % (VOCAB - 3) for index in range(PROMPT)]
    request = core.make_request(
        prompt,
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
        kv=Mix("h2o", max_tokens=CAP, quant=quant),
    )
    core.add(request)
    form = StoredForm.of(make_quantizer(quant))
    restored: dict[tuple[int, int, int], torch.Tensor] = {}  # (layer, head, position) -> its restored key and value
    previous_pages: dict[tuple[int, int], set[int]] = {}
    compared, changes, repacks = 0, 0, 0  # rows compared; compactions that changed a head's pages; repacks
    while core.has_work:
        core.step()
        region = request.region
        if region is None or request.done:
            continue
        assert region.quant is not None
        assert region.quant.ids.stats().used == region.num_pages  # a page keeping no row went back
        for layer in range(len(region.counts)):
            keys, values = region.read(core.kv._storage, layer)
            full = region.sink_keys[layer].shape[0]
            for head, count in enumerate(region.counts[layer]):
                rows, positions = region.rows[layer][head, :count], region.positions[layer][head, :count]
                quantized = rows >= full
                # the residual: rows in the model's dtype newer than every quantized row, fewer
                # than the window and one group (more would have settled)
                if bool(quantized.any()):
                    newest_quantized = int(positions[quantized].max())
                    residual = int((~quantized & (positions > newest_quantized)).sum())
                    assert residual < form.residual_length + form.group_size
                    sinks = int((~quantized & (positions < int(positions[quantized].min()))).sum())
                    assert sinks <= form.sink_tokens
                    assert residual + sinks == int((~quantized).sum())
                per_page = region.quant.page_tokens
                assert len(region.pages[layer][head]) <= 2 * int(quantized.sum()) / per_page + 2
                # pages it shares with the previous step: its rows there kept their codes; none
                # shared: its pages were repacked (or it had none)
                pages, before = set(region.pages[layer][head]), previous_pages.get((layer, head), set())
                repacked = bool(pages and before) and not pages & before
                previous_pages[(layer, head)] = pages
                for index in quantized.nonzero().flatten().tolist():
                    key = (layer, head, int(positions[index]))
                    row = torch.cat([keys[head, index], values[head, index]])
                    if key in restored and not repacked:
                        compared += 1
                        assert torch.equal(restored[key], row), f"{key} was quantized again"
                    restored[key] = row
                changes += bool(pages and before) and pages != before
                repacks += repacked
    assert request.error is None and len(request.output) == NEW_TOKENS
    assert compared > 1000  # rows were read back across many compactions
    # quantizing kept rows again at every compaction compounds the codec's error: a head's pages
    # are repacked only when evictions leave them sparse, a few times in a run
    assert changes > 20 and repacks <= 0.1 * changes, (repacks, changes)
    assert core.kv._quantized_pages[make_quantizer(quant).spec].used_bytes() == 0
