"""Asynchronous rollouts (`schedule.max_staleness`): the loss's ratio against the sampling policy,
and the config's rules.  A launch whose sampler works ahead on its own rank:
test_train_integration.test_async_sampler_works_ahead_and_a_resumed_run_keeps_the_prompt_order.

The toy batch is test_rollout_correction's: the trainer's log-probs and the sampler's differ by
ρ = π_trainer / π_sampler = [[.5, 1, 3], [1.5, 2.5, 1]], advantages [1, -2], the last token of row 1
is not a response token, 5 response tokens in all.
"""
import pytest
import torch

from rlft.batching.batch import Labels
from rlft.config import ConfigError, GRPOConfig, build_config, config_warnings
from rlft.objectives import GRPOObjective

TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]])
RATIO = torch.tensor([[0.5, 1.0, 3.0], [1.5, 2.5, 1.0]])
SAMPLER = TRAINER - torch.log(RATIO)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([1.0, -2.0])


def grpo_clip_loss(off_policy: bool) -> tuple[float, torch.Tensor, dict]:
    g = GRPOConfig(loss_type="grpo_clip", aggregation="token", cliprange=0.2, kl_coef=0.0)
    objective = GRPOObjective(g, max_tokens=3, off_policy=off_policy)
    logp = TRAINER.clone().requires_grad_(True)
    labels = Labels(response_mask=MASK, advantages=ADV, raw_rewards=ADV, sampler_logprobs=SAMPLER)
    loss, metrics = objective.loss(logp, torch.ones(2, 3), labels, num_tokens_total=5.0, num_micro_batches=1)
    loss.backward()
    return float(loss.detach()), logp.grad, metrics


def test_off_policy_ratio_is_against_the_sampling_policy():
    # Per token -min(ρA, clip(ρ, .8, 1.2)A): row 0 (A=1) -> -.5, -1, -1.2 (ρ=3 clipped);
    # row 1 (A=-2) -> 3, 5 (the unclipped ρA is the smaller).  Token mean over 5: 5.3 / 5.
    loss, grad, metrics = grpo_clip_loss(off_policy=True)
    assert loss == pytest.approx(1.06, abs=1e-6)
    # d/dlogp of -ρA/5 where unclipped: -.5/5, -1/5, 0 (clipped), then 3/5, 5/5, 0 (masked).
    assert torch.allclose(grad, torch.tensor([[-0.1, -0.2, 0.0], [0.6, 1.0, 0.0]]), atol=1e-6)
    assert float(metrics["ratio_max"]) == pytest.approx(3.0, rel=1e-5)


def test_on_policy_ratio_is_one():
    # The same batch on-policy: old log-probs are the current ones, ρ = 1, per token -A.
    loss, grad, metrics = grpo_clip_loss(off_policy=False)
    assert loss == pytest.approx((-3.0 + 4.0) / 5, abs=1e-6)
    assert torch.allclose(grad, -ADV[:, None] * MASK / 5)
    assert float(metrics["ratio_max"]) == 1.0


def test_config_rules():
    assert build_config({}).schedule.max_staleness == 0
    with pytest.raises(ConfigError, match="schedule.max_staleness: must be >= 0"):
        build_config({}, ["schedule.max_staleness=-1"])
    with pytest.raises(ConfigError, match="needs schedule.sync_every: 1"):
        build_config({}, ["schedule.max_staleness=1", "schedule.sync_every=2"])
    uncorrected = build_config({}, ["schedule.max_staleness=1", "grpo.loss_type=reinforce_with_baseline"])
    assert any("grpo.rollout_is: tis" in w for w in config_warnings(uncorrected))
    corrected = build_config({}, ["schedule.max_staleness=1", "grpo.loss_type=reinforce_with_baseline",
                                  "grpo.rollout_is=tis"])
    assert not any("max_staleness" in w for w in config_warnings(corrected))
    assert not any("max_staleness" in w for w in config_warnings(build_config({}, ["schedule.max_staleness=2"])))


@pytest.mark.parametrize("overrides, level", [
    ([], 2),  # every step syncs before the engine generates again: its weights may be dropped
    (["schedule.sync_every=2"], 1),  # a step without a sync samples with the weights it kept
    (["schedule.max_staleness=1"], 1),  # the engine generates ahead, before the next sync
])
def test_the_engine_drops_its_weights_in_sleep_only_when_a_sync_replaces_them(overrides, level):
    from rlft.roles.rollout import RolloutWorker

    worker = RolloutWorker.__new__(RolloutWorker)  # the rule reads only the config
    worker.cfg = build_config({}, overrides)
    assert worker.sleep_level == level
