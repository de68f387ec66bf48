import torch

from armor_trl.anchors import anchor_rows, fill_groups, policy_rows, select_anchors, verified_mask


def test_row_layout():
    assert anchor_rows(8, 4) == [3, 7]
    assert policy_rows(8, 4) == [0, 1, 2, 4, 5, 6]


def test_fill_groups_puts_anchor_last_in_each_group():
    assert fill_groups(["a", "b", "c", "d"], ["X", "Y"], 3) == ["a", "b", "X", "c", "d", "Y"]


def test_select_first_verified_candidate_per_group():
    nan = float("nan")
    rewards = torch.tensor(
        [
            [0.0, 0.0], [1.0, 0.5], [1.0, 1.0],  # group 0: candidate 1 is the first reaching 1.0 (weighted)
            [0.5, 0.0], [0.0, 0.0], [0.9, 0.0],  # group 1: none
            [nan, 1.0], [1.0, nan], [0.5, 1.0],  # group 2: NaN never verifies -> candidate 2
        ]
    )
    weights = torch.tensor([1.0, 0.5])
    chosen, reward = select_anchors(rewards, weights, num_candidates=3, threshold=1.0)
    assert chosen.tolist() == [1, -1, 2]
    assert reward[0].item() == 1.25 and torch.isnan(reward[1]) and reward[2].item() == 1.0


def test_none_reward_is_never_verified():
    rewards = torch.tensor([[float("nan"), 5.0]])
    assert not verified_mask(rewards, torch.ones(2), threshold=1.0).item()
