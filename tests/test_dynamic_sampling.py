"""Dynamic sampling: which groups are kept, dropped and filled in, on hand-made rewards."""
import pytest
import torch

from rlft.batching.dynamic_sampling import GroupPool, group_rows, informative_groups
from rlft.batching.round_size import RoundSizer, most_prompts_per_round, prompts_for_keep_rate
from conftest import rollout_rows


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
        "dynamic_sampling/rounds": 2.0, "dynamic_sampling/groups_generated": 6.0, "dynamic_sampling/groups_first_round": 3.0,
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
    r = rollout_rows([[5], [5], [6], [6]], [[1], [2], [3], [4]], ["stop"] * 4, texts=["a", "b", "c", "d"],
                     ground_truths=["7", "7", "8", "8"], logprobs=[[-0.1], [-0.2], [-0.3], [-0.4]], indices=[0, 0, 1, 1])
    both = r + [r[2], r[3]]
    assert [row.text for row in both] == ["a", "b", "c", "d", "c", "d"]
    picked = [both[i] for i in group_rows([0, 2], 2)]
    assert [row.text for row in picked] == ["a", "b", "c", "d"]
    assert [row.example.ground_truth for row in picked] == ["7", "7", "8", "8"]
    assert [row.logprobs for row in picked] == [[-0.1], [-0.2], [-0.3], [-0.4]]


def test_auto_rounds_draw_for_the_missing_groups_at_the_keep_rate_with_two_deviations_of_margin():
    # n p - 2 sqrt(n p (1 - p)) >= m.  m = 32, p = 0.52: n = 78 gives 40.56 - 2 sqrt(19.469) = 31.74 < 32,
    # n = 79 gives 41.08 - 2 sqrt(19.718) = 32.20: 79 prompts (P(fewer than 32 kept) = 1.5 %).
    assert prompts_for_keep_rate(32, 0.52) == 79
    # m = 1, p = 0.5: n = 7 gives 3.5 - 2 sqrt(1.75) = 0.85 < 1, n = 8 gives 4 - 2 sqrt(2) = 1.17.
    assert prompts_for_keep_rate(1, 0.5) == 8
    assert prompts_for_keep_rate(32, 1.0) == 32  # every group kept: no margin needed
    sizer = RoundSizer("auto", 32)
    assert sizer.keep_rate is None and sizer.prompts_for(32) == 32  # nothing seen yet: today's round
    sizer.saw(32, 16)
    # p = 0.5, m = 16: n = 45 gives 22.5 - 2 sqrt(11.25) = 15.79, n = 46 gives 23 - 2 sqrt(11.5) = 16.22.
    assert sizer.keep_rate == 0.5 and sizer.prompts_for(16) == 46
    sizer.saw(40, 36)  # earlier counts weigh 0.7: (0.7 x 16 + 36) / (0.7 x 32 + 40) = 47.2 / 62.4
    assert sizer.keep_rate == pytest.approx(47.2 / 62.4)
    assert sizer.prompts_for(0) == 0
    again = RoundSizer("auto", 32)
    again.load_state_dict(sizer.state_dict())
    assert again.keep_rate == sizer.keep_rate and again.prompts_for(20) == sizer.prompts_for(20)
    # A keep rate below 1/3 counts as 1/3, and a round never draws more than 3x the step's prompts.
    sizer.saw(500, 0)
    assert sizer.keep_rate < 0.1 and sizer.prompts_for(32) == 96 == most_prompts_per_round("auto", 32)
    # m = 2 at p = 1/3: n = 17 gives 5.67 - 2 sqrt(3.78) = 1.78 < 2, n = 18 gives 6 - 2 sqrt(4) = 2.
    assert sizer.prompts_for(2) == 18


def test_a_fixed_oversample_draws_that_multiple_of_the_missing_groups():
    sizer = RoundSizer(1.5, 32)
    assert [sizer.prompts_for(m) for m in (32, 5, 1)] == [48, 8, 2]
    sizer.saw(48, 2)  # the keep rate does not change a fixed factor
    assert sizer.prompts_for(32) == 48 and most_prompts_per_round(1.5, 32) == 48
    plain = RoundSizer(1.0, 32)
    assert [plain.prompts_for(m) for m in (32, 7)] == [32, 7] and most_prompts_per_round(1.0, 32) == 32


@pytest.mark.parametrize("overrides, message", [
    (["grpo.dynamic_sampling=true", "grpo.oversample=0.5"], "grpo.oversample: must be a number >= 1 or auto, got 0.5"),
    (["grpo.dynamic_sampling=true", "grpo.oversample=more"], "grpo.oversample: must be a number >= 1 or auto, got 'more'"),
    (["grpo.dynamic_sampling=true", "grpo.oversample=inf"], "grpo.oversample: must be a number >= 1 or auto, got inf"),
    (["grpo.oversample=auto"], "grpo.oversample: auto sizes the rounds of dynamic sampling, which is off; set "
                               "grpo.dynamic_sampling: true or leave grpo.oversample at 1"),
])
def test_oversample_settings_are_checked(overrides, message):
    from rlft.config import ConfigError, build_config

    with pytest.raises(ConfigError) as err:
        build_config({}, overrides)
    assert str(err.value) == message
    assert build_config({}, ["grpo.dynamic_sampling=true", "grpo.oversample=auto"]).grpo.oversample == "auto"
    assert build_config({}, ["grpo.dynamic_sampling=true", "grpo.oversample=2"]).grpo.oversample == 2.0
