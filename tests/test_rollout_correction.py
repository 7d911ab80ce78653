"""The sampler's log-probs against the trainer's: TIS weights, the weighted loss and the mismatch
metrics on a toy batch of 2 sequences x 3 tokens, worked by hand.

The toy batch: the trainer's log-probs (of the weights that sampled) and the sampler's differ by
log ρ = logp_trainer - logp_sampler = [[ln .5, 0, ln 3], [ln 1.5, ln 2.5, 0]], the last token of
row 1 is not a response token.  With cap 2 the TIS weights are min(ρ, 2) = [[.5, 1, 2], [1.5, 2, 1]].
"""
import math

import pytest
import torch

from rlft.batching.batch import Labels, RolloutBatch
from rlft.config import GRPOConfig
from rlft.grpo import (
    ROLLOUT_MISMATCH_METRIC_KEYS,
    MicroBatchMismatch,
    policy_loss,
    rollout_mismatch_metrics,
    rollout_mismatch_sums,
    truncated_is_weights,
)
from rlft.objectives import GRPOObjective

TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]])
RATIO = torch.tensor([[0.5, 1.0, 3.0], [1.5, 2.5, 1.0]])
SAMPLER = TRAINER - torch.log(RATIO)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([1.0, -2.0])


def close(got, want, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float32),
                               torch.as_tensor(want, dtype=torch.float32), atol=tol, rtol=0)


def k3(r: float) -> float:
    return r - 1 - math.log(r)


# The response tokens' ratios: .5, 1, 3, 1.5, 2.5.
EXPECTED = {
    "rollout_mismatch/kl": (k3(0.5) + k3(1.0) + k3(3.0) + k3(1.5) + k3(2.5)) / 5,  # .354549
    "rollout_mismatch/kl_k1": -(math.log(0.5) + math.log(3.0) + math.log(1.5) + math.log(2.5)) / 5,  # -.345462
    "rollout_mismatch/ratio_mean": (0.5 + 1 + 3 + 1.5 + 2.5) / 5,  # 1.7
    "rollout_mismatch/ratio_max": 3.0,
    "rollout_mismatch/ratio_min": 0.5,
    "rollout_mismatch/capped_fraction": 2 / 5,  # 3 and 2.5 exceed the cap 2
}


def test_truncated_is_weights_by_hand():
    w = truncated_is_weights(TRAINER, SAMPLER, cap=2.0)
    close(w, [[0.5, 1.0, 2.0], [1.5, 2.0, 1.0]])
    assert not w.requires_grad
    close(truncated_is_weights(TRAINER, SAMPLER, cap=1.0), [[0.5, 1.0, 1.0], [1.0, 1.0, 1.0]])
    # A token the sampler all but excluded does not overflow: its weight is the cap.
    assert truncated_is_weights(torch.tensor([[0.0]]), torch.tensor([[-1e4]]), cap=2.0).item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="shape"):
        truncated_is_weights(TRAINER, SAMPLER[:, :2], cap=2.0)


def test_mismatch_metrics_by_hand():
    got = rollout_mismatch_metrics(TRAINER, SAMPLER, MASK, cap=2.0)
    assert tuple(got) == ROLLOUT_MISMATCH_METRIC_KEYS
    for key, want in EXPECTED.items():
        close(got[key], want)
    close(got["rollout_mismatch/kl"], 0.354549)
    # Identical log-probs: no mismatch at all.
    same = rollout_mismatch_metrics(TRAINER, TRAINER, MASK, cap=2.0)
    assert [v.item() for v in same.values()] == [0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    # Nothing masked in: zeros, not NaN or inf.
    empty = rollout_mismatch_metrics(TRAINER, SAMPLER, torch.zeros_like(MASK), cap=2.0)
    assert all(v.item() == 0.0 for v in empty.values())


def test_tis_weighted_loss_and_gradient_by_hand():
    logp = TRAINER.clone().requires_grad_(True)
    w = truncated_is_weights(logp, SAMPLER, cap=2.0)
    loss, metrics = policy_loss(logp, MASK, loss_type="reinforce_with_baseline", advantages=ADV,
                                aggregation="token", rollout_is_weights=w)
    # per token -A·logp: row 0 [1, 2, .5], row 1 [-2, -2, ·]; times w: [.5, 2, 1], [-3, -4, ·]
    # token mean over 5 response tokens: (.5 + 2 + 1 - 3 - 4)/5 = -.7
    close(loss, -0.7)
    close(metrics["pg_loss"], -0.7)
    loss.backward()
    # d/dlogp = -A·w/5: row 0 -[.5, 1, 2]/5, row 1 2·[1.5, 2, ·]/5
    close(logp.grad, [[-0.1, -0.2, -0.4], [0.6, 0.8, 0.0]])
    # Sequence aggregation: row 0 mean 3.5/3, row 1 mean -7/2 -> (3.5/3 - 3.5)/2 = -7/6
    loss_seq, _ = policy_loss(TRAINER, MASK, loss_type="reinforce_with_baseline", advantages=ADV,
                              rollout_is_weights=w)
    close(loss_seq, -7 / 6)
    # Unweighted for comparison: (1 + 2 + .5 - 2 - 2)/5 = -.1
    plain, _ = policy_loss(TRAINER, MASK, loss_type="reinforce_with_baseline", advantages=ADV, aggregation="token")
    close(plain, -0.1)


def labels(rows=slice(None)) -> Labels:
    return Labels(response_mask=MASK[rows], advantages=ADV[rows], raw_rewards=ADV[rows],
                  sampler_logprobs=SAMPLER[rows])


@pytest.mark.parametrize("rollout_is, want_loss", [("tis", -0.7), ("none", -0.1)])
def test_grpo_objective_weights_only_with_tis_and_always_measures(rollout_is, want_loss):
    g = GRPOConfig(loss_type="reinforce_with_baseline", aggregation="token", rollout_is=rollout_is)
    objective = GRPOObjective(g, max_tokens=3)
    assert "sampler_logprobs" in objective.label_fields
    loss, metrics = objective.loss(TRAINER.clone(), torch.ones(2, 3), labels(), num_tokens_total=5.0,
                                   num_micro_batches=1)
    close(loss, want_loss)
    assert set(metrics) == set(objective.metric_names)
    for key, want in EXPECTED.items():  # measured whether TIS is on or off
        close(metrics[key], want)


def test_micro_batches_report_the_whole_batch_metrics():
    """One row per micro-batch: DeepSpeed averages the two reports; that average is the whole
    batch's metrics (token-weighted means, the true max and min), step after step."""
    g = GRPOConfig(loss_type="reinforce_with_baseline", aggregation="token", rollout_is="tis")
    objective = GRPOObjective(g, max_tokens=3)
    for _ in range(2):  # the second step starts afresh
        reports = [objective.loss(TRAINER[r:r + 1].clone(), torch.ones(1, 3), labels(slice(r, r + 1)),
                                  num_tokens_total=5.0, num_micro_batches=2)[1] for r in (0, 1)]
        for key, want in EXPECTED.items():
            close((reports[0][key] + reports[1][key]) / 2, want)
        # A plain mean of per-micro-batch values would be wrong: row 0 alone has ratio_max 3, row 1 2.5.
        assert EXPECTED["rollout_mismatch/ratio_max"] != (3.0 + 2.5) / 2


def test_micro_batch_accumulator_with_an_empty_micro_batch():
    acc = MicroBatchMismatch()
    empty = rollout_mismatch_sums(TRAINER[:1], SAMPLER[:1], torch.zeros(1, 3), cap=2.0)
    full = rollout_mismatch_sums(TRAINER, SAMPLER, MASK, cap=2.0)
    reports = [acc.report(empty, 2), acc.report(full, 2)]
    for key, want in EXPECTED.items():
        close((reports[0][key] + reports[1][key]) / 2, want)
    assert all(v.item() == 0.0 for v in reports[0].values())


def test_a_batch_without_sampler_logprobs_trains_alike_and_measures_nothing():
    """A step that did not ask the sampler for log-probs (not a grpo.mismatch_metrics_every step):
    the field travels as an empty tensor, the loss is the same as with them, the mismatch metrics
    are 0 in the pipeline's report and left out of the step's log."""
    g = GRPOConfig(loss_type="reinforce_with_baseline", aggregation="token")
    objective = GRPOObjective(g, max_tokens=3)
    assert objective.optional_label_fields == ("sampler_logprobs",)
    batch = RolloutBatch(input_ids=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 4),
                         response_mask=MASK, prompt_lengths=torch.ones(2), response_lengths=torch.ones(2),
                         advantages=ADV, raw_rewards=ADV)
    fields = objective.label_fields
    with pytest.raises(ValueError, match="sampler_logprobs"):
        Labels.of(batch, fields)
    carried = Labels.of(batch, fields, objective.optional_label_fields).select(slice(None), 4).pack(fields)
    assert carried[fields.index("sampler_logprobs")].shape == (2, 0)
    unpacked = Labels.unpack(fields, carried)
    assert unpacked.sampler_logprobs is None
    loss, metrics = objective.loss(TRAINER.clone(), torch.ones(2, 3), unpacked, num_tokens_total=5.0,
                                   num_micro_batches=1)
    close(loss, -0.1)  # as with the sampler's log-probs and rollout_is none (above)
    assert set(metrics) == set(objective.metric_names)
    assert all(metrics[k].item() == 0.0 for k in ROLLOUT_MISMATCH_METRIC_KEYS)
    assert objective.unmeasured(batch) == ROLLOUT_MISMATCH_METRIC_KEYS
    batch.sampler_logprobs = SAMPLER
    assert objective.unmeasured(batch) == ()
    # The next step measures again, from a fresh start.
    _, metrics = objective.loss(TRAINER.clone(), torch.ones(2, 3), labels(), num_tokens_total=5.0,
                                num_micro_batches=1)
    for key, want in EXPECTED.items():
        close(metrics[key], want)


@pytest.mark.parametrize("overrides, want", [
    ({}, False),
    ({"rollout_is": "tis"}, True),
])
def test_the_loss_reads_sampler_logprobs_only_with_tis_or_off_policy(overrides, want):
    g = GRPOConfig(**overrides)
    assert g.loss_reads_sampler_logprobs(max_staleness=0) is want
    assert g.loss_reads_sampler_logprobs(max_staleness=1) is True
    assert GRPOObjective(g, max_tokens=3, off_policy=True).optional_label_fields == ()
    assert GRPOObjective(g, max_tokens=3).optional_label_fields == (() if want else ("sampler_logprobs",))


def test_which_steps_ask_the_sampler_for_logprobs():
    steps = range(1, 23)
    asked = lambda g, staleness=0: [s for s in steps if g.wants_sampler_logprobs(s, staleness)]
    assert asked(GRPOConfig()) == [1, 11, 21]  # the default: step 1 and every 10th after it
    assert asked(GRPOConfig(mismatch_metrics_every=1)) == list(steps)
    assert asked(GRPOConfig(mismatch_metrics_every=0)) == []
    assert asked(GRPOConfig(mismatch_metrics_every=0, rollout_is="tis")) == list(steps)
    assert asked(GRPOConfig(mismatch_metrics_every=0), staleness=2) == list(steps)
