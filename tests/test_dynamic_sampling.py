"""Dynamic sampling: which groups are kept, dropped and filled in, on hand-made rewards."""
import pytest
import torch

from rlft.batching.dynamic_sampling import GroupPool, group_rows, informative_groups
from rlft.roles.generation import Rollout


def test_informative_groups_flags_groups_whose_rewards_differ():
    rewards = torch.tensor([0., 0., 0.,   1., 0., 0.,   1., 1., 1.,   0., 0.1, 0.])
    assert informative_groups(rewards, 3).tolist() == [False, True, False, True]
    # A tolerance treats tiny differences (e.g. shaping noise) as equal.
    assert informative_groups(rewards, 3, tol=0.5).tolist() == [False, True, False, False]
    with pytest.raises(ValueError, match="groups of 5"):
        informative_groups(rewards, 5)


def test_pool_refills_from_later_rounds_and_stops_when_full():
    pool = GroupPool(target_groups=3)
    pool.add_round(torch.tensor([False, True, False]))   # groups 0, 1, 2: only 1 informative
    assert not pool.full
    pool.add_round(torch.tensor([True, False, True]))    # groups 3, 4, 5: 3 and 5 informative
    assert pool.full
    assert pool.selection() == [1, 3, 5]
    assert pool.stats() == {
        "dynamic_sampling/rounds": 2.0, "dynamic_sampling/groups_generated": 6.0,
        "dynamic_sampling/groups_informative": 3.0, "dynamic_sampling/groups_dropped": 3.0,
        "dynamic_sampling/groups_filled_zero_variance": 0.0}


def test_pool_fills_with_earliest_zero_variance_groups_when_rounds_run_out():
    pool = GroupPool(target_groups=4)
    pool.add_round(torch.tensor([False, False, True, False]))
    pool.add_round(torch.tensor([False, True, False, False]))
    # Informative: 2 and 5; two more needed, taken from the earliest spare groups 0 and 1.
    assert pool.selection() == [0, 1, 2, 5]
    stats = pool.stats()
    assert stats["dynamic_sampling/groups_filled_zero_variance"] == 2.0
    assert stats["dynamic_sampling/groups_dropped"] == 4.0


def test_selected_rows_follow_the_group_major_layout():
    assert group_rows([1, 3], 2) == [2, 3, 6, 7]
    r = Rollout([0, 0, 1, 1], [[5], [5], [6], [6]], [[1], [2], [3], [4]], ["a", "b", "c", "d"],
                ["7", "7", "8", "8"], ["stop"] * 4, ["p0", "p0", "p1", "p1"], [[-0.1], [-0.2], [-0.3], [-0.4]])
    both = Rollout.empty().extend(r).extend(r.select([2, 3]))
    assert both.responses == ["a", "b", "c", "d", "c", "d"]
    picked = both.select(group_rows([0, 2], 2))
    assert picked.responses == ["a", "b", "c", "d"] and picked.ground_truths == ["7", "7", "8", "8"]
    assert picked.logprobs == [[-0.1], [-0.2], [-0.3], [-0.4]]
