"""`fill_pages`: a quantized mix's ratio keeps whole pages after each head's sinks."""

from __future__ import annotations

import pytest
import torch

from kvwise.kv.quantizer import make_quantizer
from kvwise.kv.stored_form import PER_TOKEN_PAGE, StoredForm, fill_pages

pytestmark = pytest.mark.timeout(60)


def test_the_last_page_is_filled_by_the_best_tokens_left_out():
    scores = torch.tensor([[9.0, 1.0, 8.0, 2.0, 7.0, 3.0, 6.0, 4.0, 5.0, 0.0]])
    keep = torch.zeros(1, 10, dtype=torch.bool)
    keep[0, [0, 2, 4]] = True  # a sink and two tokens: the page of 4 they start has room for 2
    valid = torch.ones_like(keep)
    filled = fill_pages(keep, scores, valid, page_tokens=4, sinks=1)
    assert filled[0].nonzero().flatten().tolist() == [0, 2, 4, 6, 8]  # 6 and 8 score next best


def test_rows_fill_apart_never_take_invalid_tokens_and_stop_when_none_are_left():
    keep = torch.tensor([[True, True, False, False, False], [True, False, False, False, False]])
    valid = torch.tensor([[True, True, True, False, True], [True, True, False, False, False]])
    scores = torch.tensor([[0.0, 0.0, 1.0, 9.0, float("-inf")], [0.0, float("nan"), 0.0, 0.0, 0.0]])
    filled = fill_pages(keep, scores, valid, page_tokens=4, sinks=0)
    # row 0 wants 2 more and has 2 valid spares (one scored -inf); row 1 wants 3 and has 1
    assert filled.tolist() == [[True, True, True, False, True], [True, True, False, False, False]]


def test_whole_pages_and_sinks_only_are_left_alone():
    keep = torch.tensor([[True, True, True, True, True, False, False, False, False]])
    scores, valid = torch.rand(1, 9), torch.ones(1, 9, dtype=torch.bool)
    assert torch.equal(fill_pages(keep, scores, valid, page_tokens=4, sinks=1), keep)  # a sink and one page
    sink_only = torch.zeros_like(keep)
    sink_only[0, 0] = True
    assert torch.equal(fill_pages(sink_only, scores, valid, page_tokens=4, sinks=1), sink_only)
    assert torch.equal(fill_pages(keep[:, :3], scores[:, :3], valid[:, :3], page_tokens=1, sinks=0), keep[:, :3])


@pytest.mark.parametrize(
    ("name", "page"),
    [("kivi2", 32), ("kivi4:group_size=16:residual_length=32", 16), ("int8", PER_TOKEN_PAGE), ("fp8", PER_TOKEN_PAGE)],
)
def test_a_page_is_a_key_group_or_the_per_token_page(name, page):
    assert StoredForm.of(make_quantizer(name)).page_tokens() == page
