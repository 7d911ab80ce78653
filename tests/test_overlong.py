"""Overlong responses (cut by max_tokens): filtering out of the loss and DAPO's soft penalty, on a
hand-made group of 4 responses, worked by hand."""
from types import SimpleNamespace

import pytest
import torch

from rlft.config import build_config
from rlft.batching.overlong import soft_overlong_penalty, truncated_rows
from conftest import rollout_rows
from rlft.roles.rollout import RolloutWorker

PAD, BOS, EOS = 0, 1, 2


def test_soft_penalty_is_zero_before_the_buffer_and_linear_inside_it():
    # max_tokens 10, buffer 4: the penalty starts after 6 tokens and reaches -penalty at 10.
    lengths = torch.tensor([1, 6, 7, 8, 9, 10])
    got = soft_overlong_penalty(lengths, max_tokens=10, buffer=4, penalty=1.0)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0]
    assert soft_overlong_penalty(lengths, 10, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.375, -0.5]
    assert soft_overlong_penalty(torch.tensor([12]), 10, 4, 1.0).tolist() == [-1.0]  # never below -penalty
    # buffer = max_tokens: the penalty grows from the first token.
    torch.testing.assert_close(soft_overlong_penalty(lengths, 10, 10, 1.0),
                               torch.tensor([-0.1, -0.6, -0.7, -0.8, -0.9, -1.0]))
    with pytest.raises(ValueError, match="between 1 and max_tokens"):
        soft_overlong_penalty(lengths, 10, 0, 1.0)


def test_truncated_rows_are_the_length_finishes():
    assert truncated_rows(["stop", "length", "eos", "length"]).tolist() == [False, True, False, True]


def worker(environment: dict | None = None, **grpo) -> RolloutWorker:
    """The rollout role's batch-building half, without an engine, data or grader."""
    chat = {"prompt_template": "chat"} if (environment or {}).get("name") else {}  # tools need a chat prompt
    cfg = build_config({"grpo": {"group_size": 4, **grpo}, "sampling": {"max_tokens": 10}, "data": chat,
                        "optim": {"rollout_batch_size": 4}, "environment": environment or {}})
    w = RolloutWorker.__new__(RolloutWorker)
    w.cfg, w.group_size = cfg, 4
    w.tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
    return w


# One group: responses of 5, 6, 8 and 10 tokens (the last cut by max_tokens = 10), rewards 1, 0, 1, 1.
LENGTHS = [5, 6, 8, 10]
ROLLOUT = rollout_rows([[7, 8]] * 4, [[3 + i] * n for i, n in enumerate(LENGTHS)], ["stop", "eos", "stop", "length"],
                       logprobs=[[-0.5] * n for n in LENGTHS])
GRADES = [{"reward": r, "format_reward": 1.0, "answer_reward": r} for r in (1.0, 0.0, 1.0, 1.0)]


def test_soft_penalty_changes_rewards_before_group_normalisation():
    w = worker(overlong="soft_penalty", overlong_buffer=4, overlong_penalty=1.0, advantage_estimator="dr_grpo")
    batch, stats = w.to_batch(ROLLOUT, GRADES)
    # penalties: 5, 6 tokens -> 0; 8 -> (6 - 8)/4 = -.5; 10 -> -1.  Rewards 1, 0, .5, 0; mean .375.
    assert batch.raw_rewards.tolist() == [1.0, 0.0, 0.5, 0.0]
    assert batch.advantages.tolist() == [0.625, -0.375, 0.125, -0.375]
    assert stats["reward_mean"] == 0.375
    assert w.filter_overlong(batch, ROLLOUT) == {"overlong/penalised": 2.0, "overlong/penalty_mean": -0.375}
    # With the std: deviations / (std + eps), std = sqrt(.6875 / 3) = .478714
    w = worker(overlong="soft_penalty", overlong_buffer=4, overlong_penalty=1.0)
    batch, _ = w.to_batch(ROLLOUT, GRADES)
    torch.testing.assert_close(batch.advantages, torch.tensor([0.625, -0.375, 0.125, -0.375]) / (0.478714 + 1e-6))
    # Off: the reward function's rewards 1, 0, 1, 1 (mean .75).
    batch, _ = worker(advantage_estimator="dr_grpo").to_batch(ROLLOUT, GRADES)
    assert batch.raw_rewards.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert batch.advantages.tolist() == [0.25, -0.75, 0.25, 0.25]


def test_an_episodes_soft_penalty_counts_against_the_episodes_budget():
    # Turns of at most 10 tokens, episodes of at most 20 (tool replies included), buffer 4: the penalty
    # starts after 16 of the episode's tokens, not after 6.
    w = worker({"name": "calculator", "max_episode_tokens": 20}, overlong="soft_penalty", overlong_buffer=4,
               overlong_penalty=1.0)
    lengths = [5, 16, 18, 20]
    episodes = rollout_rows([[7, 8]] * 4, [[3] * n for n in lengths], ["eos"] * 3 + ["max_tokens"],
                            response_masks=[[1] * 5] + [[1] * 4 + [0] * (n - 4) for n in lengths[1:]])
    assert w.overlong(episodes).reward_change.tolist() == [0.0, 0.0, -0.5, -1.0]
    # An episode cut by its budget counts as cut by max_tokens.
    assert [row.finish_reason for row in episodes] == ["eos"] * 3 + ["length"]
    # A single turn's budget stays sampling.max_tokens: max_episode_tokens caps a multi-turn environment's.
    single = worker({"max_episode_tokens": 20}, overlong="soft_penalty", overlong_buffer=4, overlong_penalty=1.0)
    assert single.overlong(ROLLOUT).reward_change.tolist() == [0.0, 0.0, -0.5, -1.0]


def test_filter_masks_exactly_the_truncated_responses():
    plain, _ = worker().to_batch(ROLLOUT, GRADES)
    w = worker(overlong="filter")
    batch, _ = w.to_batch(ROLLOUT, GRADES)
    assert torch.equal(batch.response_mask, plain.response_mask)
    metrics = w.filter_overlong(batch, ROLLOUT)
    # Row 3 (finish "length") is out of the loss; its reward still counted in its group's advantages.
    assert batch.response_mask.sum(-1).tolist() == [5.0, 6.0, 8.0, 0.0]
    assert torch.equal(batch.response_mask[:3], plain.response_mask[:3])
    assert torch.equal(batch.advantages, plain.advantages)
    assert metrics == {"overlong/filtered": 1.0}
    assert batch.response_mask.sum().item() == 19.0
    # Off: nothing changes and nothing is logged (default step records are unchanged).
    assert worker().filter_overlong(plain, ROLLOUT) == {}
    assert plain.response_mask.sum().item() == 29.0


def test_sampler_logprobs_travel_into_the_batch():
    batch, _ = worker().to_batch(ROLLOUT, GRADES)
    # Prompts of 2 tokens: response token j of each row is scored by label column 1 + j.
    assert batch.sampler_logprobs[:, 1:].sum(-1).tolist() == [-0.5 * n for n in LENGTHS]
    assert batch.sampler_logprobs[:, 0].tolist() == [0.0] * 4


@pytest.mark.parametrize("overrides, message", [
    ({"overlong": "drop"}, "grpo.overlong: must be one of none, filter, soft_penalty"),
    ({"overlong": "soft_penalty", "overlong_buffer": 11}, "grpo.overlong_buffer: must be between 1 and sampling.max_tokens (10)"),
    ({"overlong": "soft_penalty", "overlong_buffer": 0}, "grpo.overlong_buffer"),
    ({"overlong_penalty": -1.0}, "grpo.overlong_penalty: must be a finite number >= 0"),
    ({"rollout_is": "mis"}, "grpo.rollout_is: must be one of none, tis"),
    ({"rollout_is_cap": 0.5}, "grpo.rollout_is_cap: must be a number >= 1"),
])
def test_config_checks(overrides, message):
    from rlft.config import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_config({"grpo": overrides, "sampling": {"max_tokens": 10}})


def test_defaults_are_off():
    g = build_config({}).grpo
    assert (g.rollout_is, g.rollout_is_cap, g.overlong, g.overlong_buffer, g.overlong_penalty) == \
        ("none", 2.0, "none", 256, 1.0)
