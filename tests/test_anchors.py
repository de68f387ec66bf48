import pytest
import torch

from armor_trl.rollout.anchors import anchor_rows, fill_groups, policy_rows, select_anchors, verified_mask

nan = float("nan")


def test_row_layout():
    assert anchor_rows(8, 4) == [3, 7]
    assert policy_rows(8, 4) == [0, 1, 2, 4, 5, 6]


def test_row_layout_with_several_anchors_per_group():
    assert anchor_rows(8, 4, anchors_per_group=2) == [2, 3, 6, 7]
    assert policy_rows(8, 4, anchors_per_group=2) == [0, 1, 4, 5]
    assert anchor_rows(8, 4, anchors_per_group=0) == [] and policy_rows(8, 4, anchors_per_group=0) == list(range(8))


def test_fill_groups_puts_anchor_last_in_each_group():
    assert fill_groups(["a", "b", "c", "d"], ["X", "Y"], 3) == ["a", "b", "X", "c", "d", "Y"]
    assert fill_groups(["a", "b", "c", "d"], ["X", "Y", "Z", "W"], 4, anchors_per_group=2) == list("abXYcdZW")
    with pytest.raises(ValueError, match="anchor items per group"):
        fill_groups(["a", "b", "c"], ["X", "Y"], 3)


REWARDS = torch.tensor(
    [
        [0.0, 0.0], [1.0, 0.5], [1.0, 1.0],  # group 0: candidates 1 and 2 reach 1.0 (weighted)
        [0.5, 0.0], [0.0, 0.0], [0.9, 0.0],  # group 1: none
        [nan, nan], [1.0, nan], [0.5, 1.0],  # group 2: nothing applies to 0; only function 0 to 1 (1.0); 2 is 1.0
    ]
)
WEIGHTS = torch.tensor([1.0, 0.5])


def test_select_first_verified_candidate_per_group():
    chosen, reward = select_anchors(REWARDS, WEIGHTS, num_candidates=3, threshold=1.0)
    assert chosen.tolist() == [[1], [-1], [1]]
    assert reward[0, 0].item() == 1.25 and torch.isnan(reward[1, 0]) and reward[2, 0].item() == 1.0


def test_select_several_anchors_in_candidate_order():
    chosen, reward = select_anchors(REWARDS, WEIGHTS, num_candidates=3, threshold=1.0, anchors_per_group=2)
    assert chosen.tolist() == [[1, 2], [-1, -1], [1, 2]]
    assert reward[0].tolist() == [1.25, 1.5] and reward[2].tolist() == [1.0, 1.0] and torch.isnan(reward[1]).all()


def test_selection_any_takes_candidates_regardless_of_reward():
    chosen, reward = select_anchors(REWARDS, WEIGHTS, 3, 1.0, anchors_per_group=2, selection="any")
    assert chosen.tolist() == [[0, 1], [0, 1], [0, 1]]
    assert reward[1].tolist() == [0.5, 0.0]


def test_selection_incorrect_takes_failing_candidates():
    chosen, _ = select_anchors(REWARDS, WEIGHTS, 3, 1.0, selection="incorrect")
    assert chosen.tolist() == [[0], [0], [0]]
    chosen, _ = select_anchors(torch.ones(3, 1), torch.ones(1), 3, 1.0, selection="incorrect")
    assert chosen.tolist() == [[-1]]  # every candidate is correct: no negative anchor


def test_a_reward_function_returning_none_does_not_apply():
    # TRL's multi-task convention: None = "this function does not apply to this row"
    assert verified_mask(torch.tensor([[nan, 1.0]]), torch.ones(2), threshold=1.0).item()
    assert not verified_mask(torch.tensor([[nan, 0.0]]), torch.ones(2), threshold=1.0).item()
    assert not verified_mask(torch.tensor([[nan, nan]]), torch.ones(2), threshold=0.0).item()  # nothing applies


def test_anchor_reward_funcs_limit_the_decision():
    # correctness 1.0, a length penalty of −0.5: correct when only the first function decides
    rewards, weights = torch.tensor([[1.0, -0.5]]), torch.ones(2)
    assert not verified_mask(rewards, weights, 1.0).item()
    assert verified_mask(rewards, weights, 1.0, use_funcs=torch.tensor([True, False])).item()
