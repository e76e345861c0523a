"""`whole_pages`: a quantized mix's selection keeps whole pages within the tokens it kept."""

from __future__ import annotations

import pytest
import torch

from kvwise.policies.base import PROTECTED
from kvwise.policies.selection import whole_pages

pytestmark = pytest.mark.timeout(60)


def _mask(rows: list[list[int]], width: int) -> torch.Tensor:
    mask = torch.zeros(1, len(rows), width, dtype=torch.bool)
    for row, positions in enumerate(rows):
        mask[0, row, positions] = True
    return mask


def _kept(keep: torch.Tensor) -> list[list[int]]:
    return [row.nonzero().flatten().tolist() for row in keep[0]]


def test_the_largest_remainders_round_up_by_their_best_tokens_and_the_rest_lose_their_worst():
    scores = torch.tensor(
        [
            [[9.0, 1.0, 2.0, 8.0, 7.0, 6.0, 5.0, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0, 1.0, 4.0, 2.0, 3.0, 0.0, 0.0]]
            + [[9.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]
        ]
    )
    keep = _mask([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3], [0, 1]], 10)  # after a sink each: 6, 3 and 1 tokens
    valid = torch.ones_like(keep)
    paged = whole_pages(keep, scores, valid, page_tokens=4, sinks=1)
    # 10 tokens fill 2 pages of 4: row 0 has one, and the largest remainder (row 1's 3) gets the other
    assert _kept(paged) == [[0, 3, 4, 5, 6], [0, 1, 2, 3, 5], [0]]


def test_a_protected_token_is_never_lost_and_its_row_rounds_up_first():
    scores = torch.ones(1, 2, 12)
    scores[0, 0, 1:7] = PROTECTED  # a recent window, say
    keep = _mask([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3]], 12)  # 6 and 3 tokens after the sinks
    paged = whole_pages(keep, scores, torch.ones_like(keep), page_tokens=4, sinks=1)
    counts = paged.sum(dim=-1)[0].tolist()
    assert counts == [9, 1] and bool(paged[0, 0, 1:7].all())  # 9 tokens fill 2 pages, both row 0's


def test_a_row_too_short_to_fill_its_page_keeps_it_part_empty_and_pays_for_it():
    valid = _mask([[0, 1, 2, 3], list(range(10))], 10)
    keep = _mask([[0, 1, 2, 3], [0, 1, 2, 3, 4, 5]], 10)  # 3 and 5 after the sinks; row 0 has no room left
    scores = torch.arange(10.0).flip(0).expand(1, 2, 10).clone()
    paged = whole_pages(keep, scores, valid, page_tokens=4, sinks=1)
    # 8 tokens, 2 pages: row 1 has one whole, row 0's remainder is larger and keeps the other
    assert _kept(paged) == [[0, 1, 2, 3], [0, 1, 2, 3, 4]]


def test_groups_round_apart_and_whole_pages_sinks_and_unpaged_forms_are_left_alone():
    scores = torch.rand(2, 1, 9)
    keep = torch.zeros(2, 1, 9, dtype=torch.bool)
    keep[0, 0, :5] = True  # a sink and one page: whole
    keep[1, 0, 0] = True  # a sink alone
    valid = torch.ones_like(keep)
    assert torch.equal(whole_pages(keep, scores, valid, page_tokens=4, sinks=1), keep)
    odd = keep.clone()
    odd[0, 0, 5] = True
    assert torch.equal(whole_pages(odd, scores, valid, page_tokens=1, sinks=0), odd)
    # one row alone never holds more than its tokens fill: it rounds down by its worst token
    worst = 1 + int(scores[0, 0, 1:6].argmin())
    assert _kept(whole_pages(odd, scores, valid, page_tokens=4, sinks=1)[:1]) == [[p for p in range(6) if p != worst]]


def test_invalid_tokens_are_never_taken_and_nan_scores_go_last():
    valid = _mask([[0, 1, 2, 3, 4, 5, 6, 7]], 10)
    keep = _mask([[0, 1, 2, 3, 4, 5]], 10)  # 5 after the sink: one row alone rounds down by one
    scores = torch.tensor([[[1.0, 5.0, float("nan"), 4.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0]]])
    paged = whole_pages(keep, scores, valid, page_tokens=4, sinks=1)
    assert _kept(paged) == [[0, 1, 3, 4, 5]]  # the NaN-scored token goes first
    two_rows = _mask([[0, 1, 2, 3], [0, 1, 2, 3, 4, 5]], 10)  # 3 and 5 after the sinks: 2 pages
    grouped = whole_pages(two_rows, scores.expand(1, 2, 10), valid.expand(1, 2, 10), 4, 1)
    assert not bool((grouped & ~valid).any())  # row 0 rounds up (largest remainder) from valid tokens only
    assert _kept(grouped) == [[0, 1, 2, 3, 4], [0, 1, 3, 4, 5]]
