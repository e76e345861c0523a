"""Budget selection helpers: exact totals, floors, ceilings, shared tokens, recent windows."""

import pytest
import torch

from kvwise.policies.base import PROTECTED, keep_top_across, keep_top_per_head, split_budget
from kvwise.policies.registry import make_policy
from kvwise.policies.selection import select_across_layers, with_recent_window, with_shared_tokens


def test_keep_top_per_head_respects_validity_and_budget():
    scores = torch.tensor([[[5.0, 1.0, 3.0, 9.0], [1.0, 2.0, 3.0, 4.0]]])
    valid = torch.tensor([[[True, True, True, False], [True, True, True, True]]])
    keep = keep_top_per_head(scores, valid, torch.tensor([[2, 1]]))
    assert keep.tolist() == [[[True, False, True, False], [False, False, False, True]]]


def test_keep_top_across_moves_budget_to_the_best_rows():
    scores = torch.tensor([[[9.0, 8.0, 7.0, 6.0], [1.0, 0.5, 0.2, 0.1]]])
    valid = torch.ones_like(scores, dtype=torch.bool)
    keep = keep_top_across(scores, valid, torch.tensor([4]), floor=1)
    assert keep.sum(dim=-1).tolist() == [[3, 1]]
    capped = keep_top_across(scores, valid, torch.tensor([4]), floor=0, ceiling=2)
    assert capped.sum(dim=-1).tolist() == [[2, 2]]


def test_split_budget_is_exact():
    parts = split_budget(100, [3.0, 2.0, 1.0])
    assert sum(parts) == 100 and parts[0] > parts[1] > parts[2]


def test_shared_tokens_are_protected_in_every_head():
    # 1 batch, 2 layers, 2 heads, 6 tokens; token 3 is second-best in every head, never first.
    scores = torch.tensor(
        [
            [
                [[0.1, 0.9, 0.0, 0.5, 0.2, 0.0], [0.0, 0.0, 0.8, 0.6, 0.1, 0.0]],
                [[0.0, 0.0, 0.0, 0.7, 0.9, 0.1], [0.9, 0.0, 0.0, 0.5, 0.0, 0.3]],
            ]
        ]
    )
    scores[..., 0] = PROTECTED  # a sink
    valid = torch.ones_like(scores, dtype=torch.bool)
    shared = with_shared_tokens(scores, valid, torch.tensor([1]))
    assert (shared[..., 3] >= PROTECTED).all()
    assert (shared[..., 1:3] < PROTECTED).all() and (shared[..., 4:] < PROTECTED).all()


def test_the_recent_window_is_the_last_valid_tokens_of_each_head():
    scores = torch.zeros(1, 2, 6)
    valid = torch.tensor([[[True, True, True, True, False, False], [True, True, True, True, True, True]]])
    protected = with_recent_window(scores, valid, 2) >= PROTECTED
    # a head whose last slots are padding keeps its last two real tokens
    assert protected.tolist() == [[[False, False, True, True, False, False], [False] * 4 + [True, True]]]


def test_a_global_policy_keeps_the_context_tail_within_its_budget():
    # 1 batch, 2 layers, 1 head, 16 tokens: the tail scores lowest everywhere; 8 kept per head
    scores = torch.linspace(1.0, 0.1, 16).expand(1, 2, 1, 16).clone()
    valid = torch.ones_like(scores, dtype=torch.bool)
    plain = select_across_layers(make_policy("kvzip"), 0.5, scores, valid)
    windowed = select_across_layers(make_policy("kvzip", recent_window=2), 0.5, scores, valid)
    assert not plain[..., -2:].any()
    assert windowed[..., -2:].all()
    assert int(windowed.sum()) == int(plain.sum()) == 16  # the window is paid from the budget, not on top
    # a quarter of the mean budget at most (2 here): a window of 4 keeps 2
    capped = select_across_layers(make_policy("kvzip", recent_window=4), 0.5, scores, valid)
    assert capped[..., -2:].all() and not capped[..., -4:-2].any()


@pytest.mark.parametrize("name", ["kvzip", "kvzap"])
def test_a_negative_recent_window_is_refused(name):
    with pytest.raises(ValueError, match="recent_window"):
        make_policy(name, recent_window=-1)
