"""GRPO maths against values worked out by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

from rlft.grpo import (
    POLICY_LOSS_METRIC_KEYS,
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    aggregate_loss,
    compute_entropy,
    compute_grpo_clip_loss,
    compute_group_normalized_rewards,
    compute_kl,
    KL_ESTIMATORS,
    compute_naive_policy_gradient_loss,
    compute_policy_gradient_loss,
    masked_mean,
    masked_normalize,
    policy_loss,
    register_advantage_estimator,
    register_kl_estimator,
    register_policy_loss,
)

LN2 = math.log(2.0)


def close(actual, expected, atol=1e-5):
    expected = torch.as_tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(actual.float(), expected, atol=atol, rtol=0)


# ------------------------------------------------------------------ advantages


def test_group_normalized_with_std():
    rewards = torch.tensor([1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1], dtype=torch.float32)
    adv, raw, stats = compute_group_normalized_rewards(rewards, 4, 1e-6, "grpo")
    # group 0 [1,0,0,1]: mean .5, dev ±.5, unbiased var = 4·.25/3 = 1/3, std .577350
    #   → ±.5/.577350 = ±.866025
    # group 1 [1,1,1,1]: dev 0, std 0 → 0/(0+eps) = 0
    # group 2 [0,0,0,1]: mean .25, dev [-.25,-.25,-.25,.75], var = (3·.0625+.5625)/3 = .25, std .5
    #   → [-.5,-.5,-.5,1.5]
    close(adv, [0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0, -0.5, -0.5, -0.5, 1.5])
    close(raw, rewards)
    # rewards: seven 1s, five 0s: mean 7/12 = .583333;
    # Σ(x-m)² = 7·(5/12)² + 5·(7/12)² = (175 + 245)/144 = 2.916667, unbiased std
    # sqrt(2.916667/11) = .514929
    assert stats["reward_mean"] == pytest.approx(0.583333, abs=1e-6)
    assert stats["reward_std"] == pytest.approx(0.514929, abs=1e-5)
    assert stats["reward_max"] == 1.0 and stats["reward_min"] == 0.0
    # advantages: every group sums to 0 → mean 0; Σa² = 4·.75 + 0 + (3·.25 + 2.25) = 6,
    # std sqrt(6/11) = .738549
    assert stats["advantage_mean"] == pytest.approx(0.0, abs=1e-6)
    assert stats["advantage_std"] == pytest.approx(0.738549, abs=1e-5)
    # only group 1 has all-equal rewards: 1 of 3
    assert stats["zero_variance_group_fraction"] == pytest.approx(1 / 3)


def test_group_normalized_mean_only():
    rewards = torch.tensor([1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1], dtype=torch.float32)
    adv, _, stats = compute_group_normalized_rewards(rewards, 4, 1e-6, "dr_grpo")
    # just the group mean subtracted: means .5, 1, .25
    close(adv, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -0.25, -0.25, -0.25, 0.75])
    # Σa² = 4·.25 + 0 + (3·.0625 + .5625) = 1.75 → std sqrt(1.75/11) = .398862
    assert stats["advantage_std"] == pytest.approx(0.398862, abs=1e-5)


def test_group_size_one_gives_zero_advantages_not_nan():
    rewards = torch.tensor([1.0, 0.0, 0.5])
    for estimator in ADVANTAGE_ESTIMATORS:
        adv, _, stats = compute_group_normalized_rewards(rewards, 1, 1e-6, estimator)
        close(adv, [0.0, 0.0, 0.0])
        assert stats["zero_variance_group_fraction"] == 1.0
        assert all(math.isfinite(v) for v in stats.values())
    # a single rollout: the batch std is taken as 0 too
    _, _, stats = compute_group_normalized_rewards(torch.tensor([1.0]), 1, 1e-6)
    assert stats["reward_std"] == 0.0 and stats["advantage_std"] == 0.0


def test_group_normalized_rejects_incomplete_groups():
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        compute_group_normalized_rewards(torch.ones(5), 2, 1e-6)
    with pytest.raises(ValueError, match="group_size"):
        compute_group_normalized_rewards(torch.ones(4), 0, 1e-6)
    with pytest.raises(ValueError, match="unknown advantage estimator 'rloo'; valid: grpo, dr_grpo"):
        compute_group_normalized_rewards(torch.ones(4), 2, 1e-6, "rloo")


def test_a_registered_advantage_estimator_is_used_and_carries_its_properties():
    assert {name: e.divides_by_std for name, e in ADVANTAGE_ESTIMATORS.items()} == {"grpo": True, "dr_grpo": False}
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("grpo", divides_by_std=True)(lambda grouped, eps: grouped)

    @register_advantage_estimator("_test_leave_one_out", divides_by_std=False)
    def _rloo(grouped, eps):  # RLOO: reward - mean of the other rewards of the group
        k = grouped.shape[1]
        return (grouped - grouped.mean(dim=1, keepdim=True)) * k / (k - 1)

    try:
        adv, _, _ = compute_group_normalized_rewards(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), 3, 1e-6,
                                                     "_test_leave_one_out")
        close(adv, [1.0, -0.5, -0.5, 0.0, 0.0, 0.0])  # 1 - 0, 0 - .5, 0 - .5; the equal group gives 0
    finally:
        ADVANTAGE_ESTIMATORS.pop("_test_leave_one_out")


# ------------------------------------------------------------------ per-token losses


def test_naive_policy_gradient_loss():
    adv = torch.tensor([[2.0], [-1.0]])
    logp = torch.tensor([[-0.5, -1.0], [-2.0, -0.1]])
    # -A·logp: row 0: -2·-.5 = 1, -2·-1 = 2; row 1: 1·-2 = -2, 1·-.1 = -.1
    close(compute_naive_policy_gradient_loss(adv, logp), [[1.0, 2.0], [-2.0, -0.1]])


def _ratio_inputs(ratios):
    """old logp = log .5, new logp = log(.5·ρ), so exp(new - old) = ρ."""
    ratios = torch.tensor(ratios, dtype=torch.float64)
    old = torch.full_like(ratios, math.log(0.5))
    return (old + ratios.log()).float(), old.float()


def test_grpo_clip_symmetric_values_clip_flags_and_gradient():
    adv = torch.tensor([[1.0], [-1.0]])
    logp, old = _ratio_inputs([[1.5, 0.5, 1.25], [1.5, 0.5, 0.9]])
    logp.requires_grad_(True)
    loss, meta = compute_grpo_clip_loss(adv, logp, old, cliprange=0.2)
    # A=+1: ρ=1.5 → min(1.5, 1.2) = 1.2 (clipped); ρ=.5 → min(.5, .8) = .5; ρ=1.25 → min(1.25, 1.2)
    #       = 1.2 (clipped)
    # A=-1: ρ=1.5 → min(-1.5, -1.2) = -1.5; ρ=.5 → min(-.5, -.8) = -.8 (clipped); ρ=.9 → -.9
    close(loss, [[-1.2, -0.5, -1.2], [1.5, 0.8, 0.9]])
    assert meta["clipped"].tolist() == [[True, False, True], [False, True, False]]
    close(meta["ratio"], [[1.5, 0.5, 1.25], [1.5, 0.5, 0.9]])
    # d(-ρA)/dlogp = -ρA where unclipped, 0 where the clipped (constant) term was taken
    loss.sum().backward()
    close(logp.grad, [[0.0, -0.5, 0.0], [1.5, 0.0, 0.9]])


def test_dapo_clip_higher():
    adv = torch.tensor([[1.0], [-1.0]])
    logp, old = _ratio_inputs([[1.5, 0.5, 1.25], [1.5, 0.5, 0.9]])
    loss, meta = compute_grpo_clip_loss(adv, logp, old, cliprange=0.2, cliprange_high=0.28)
    # upper bound now 1.28: ρ=1.5 → 1.28 (clipped); ρ=1.25 stays 1.25 (no longer clipped)
    # lower bound still .8: A=-1, ρ=.5 → -.8 (clipped)
    close(loss, [[-1.28, -0.5, -1.25], [1.5, 0.8, 0.9]])
    assert meta["clipped"].tolist() == [[True, False, False], [False, True, False]]
    # the registry's "dapo" gives the same
    loss2, _ = compute_policy_gradient_loss(
        logp, "dapo", advantages=adv, old_log_probs=old, cliprange=0.2, cliprange_high=0.28
    )
    close(loss2, [[-1.28, -0.5, -1.25], [1.5, 0.8, 0.9]])


def test_dispatch_no_baseline_and_reinforce():
    logp = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    # raw rewards given as [B]: -r·logp, r = [1, 0]
    rewards = torch.tensor([1.0, 0.0])
    loss, meta = compute_policy_gradient_loss(logp, "no_baseline", raw_rewards=rewards)
    close(loss, [[1.0, 2.0], [0.0, 0.0]])
    assert meta == {}
    # advantages as [B, 1]: -A·logp, A = [.5, -.5] → [.5, 1], [-1.5, -2]
    loss, _ = compute_policy_gradient_loss(
        logp, "reinforce_with_baseline", advantages=torch.tensor([[0.5], [-0.5]])
    )
    close(loss, [[0.5, 1.0], [-1.5, -2.0]])


def test_gspo_uses_sequence_ratio_over_response_only():
    # row 0: logp-old = [ln 2, 0, 3 (padding)] → s = exp((ln 2 + 0)/2) = √2 = 1.414214 > 1.2,
    #        A=+1 → loss -1.2 everywhere, clipped
    # row 1: logp-old = [ln .81, 0, 3 (padding)] → s = exp(ln .81 / 2) = .9, A=-1 → loss .9
    old = torch.full((2, 3), -1.0)
    logp = old + torch.tensor([[LN2, 0.0, 3.0], [math.log(0.81), 0.0, 3.0]])
    logp.requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, meta = compute_policy_gradient_loss(
        logp, "gspo", advantages=adv, old_log_probs=old, cliprange=0.2, response_mask=mask
    )
    close(loss, [[-1.2, -1.2, -1.2], [0.9, 0.9, 0.9]])
    assert meta["clipped"].tolist() == [[True] * 3, [False] * 3]
    # gradient per token = d(-s_t·A)/dlogp_t = -A·s = .9 on row 1, 0 on the clipped row 0
    (loss * mask).sum().backward()
    close(logp.grad, [[0.0, 0.0, 0.0], [0.9, 0.9, 0.0]])


def test_dispatch_errors_name_the_problem():
    logp = torch.zeros(2, 3)
    adv = torch.zeros(2, 1)
    with pytest.raises(ValueError, match="old_log_probs"):
        compute_policy_gradient_loss(logp, "grpo_clip", advantages=adv, cliprange=0.2)
    with pytest.raises(ValueError, match="cliprange_high"):
        compute_policy_gradient_loss(
            logp, "dapo", advantages=adv, old_log_probs=logp, cliprange=0.2
        )
    with pytest.raises(ValueError, match="raw_rewards"):
        compute_policy_gradient_loss(logp, "no_baseline", advantages=adv)
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_gradient_loss(logp, "reinforce_with_baseline", raw_rewards=adv)
    with pytest.raises(ValueError, match=r"unknown loss_type 'ppo'.*grpo_clip.*no_baseline"):
        compute_policy_gradient_loss(logp, "ppo", advantages=adv)
    with pytest.raises(ValueError, match="advantages must have shape"):
        compute_policy_gradient_loss(logp, "reinforce_with_baseline", advantages=torch.zeros(3))
    with pytest.raises(ValueError, match="old_log_probs has shape"):
        compute_policy_gradient_loss(
            logp, "grpo_clip", advantages=adv, old_log_probs=torch.zeros(2, 4), cliprange=0.2
        )


def test_registry_holds_variants_and_accepts_new_ones():
    builtin = {"no_baseline", "reinforce_with_baseline", "grpo_clip", "dapo", "gspo"}
    assert builtin <= set(POLICY_LOSSES)
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("grpo_clip", uses_ratio=True)(lambda *a, **k: None)
    # Each record carries the properties the config checks read.
    assert {name: (loss.uses_ratio, loss.uses_groups, loss.requires) for name, loss in POLICY_LOSSES.items()
            if name in builtin} == {"no_baseline": (False, False, ()), "reinforce_with_baseline": (False, True, ()),
                                    "grpo_clip": (True, True, ()), "dapo": (True, True, ("cliprange_high",)),
                                    "gspo": (True, True, ())}

    @register_policy_loss("_test_double_reinforce", uses_ratio=False)
    def _double(policy_log_probs, *, advantages, **_):
        return -2.0 * advantages * policy_log_probs, {}

    try:
        loss, _ = compute_policy_gradient_loss(
            torch.tensor([[-1.0]]), "_test_double_reinforce", advantages=torch.tensor([3.0])
        )
        close(loss, [[6.0]])  # -2·3·-1
    finally:
        POLICY_LOSSES.pop("_test_double_reinforce")


def test_every_recorded_choice_has_its_function():
    # The records (rlft.grpo.choices, read by the config checks without torch) and the maths attached
    # to them by name must not drift apart: a record without its function would pass the launch's
    # checks and fail the first step.
    from rlft.grpo.advantages import ADVANTAGE_FUNCTIONS
    from rlft.grpo.kl import KL_FUNCTIONS
    from rlft.grpo.losses import POLICY_LOSS_FUNCTIONS

    for functions in (POLICY_LOSS_FUNCTIONS, ADVANTAGE_FUNCTIONS, KL_FUNCTIONS):
        assert set(functions.records) <= set(functions), functions.kind
    with pytest.raises(ValueError, match="policy loss 'ppo' has no record in rlft.grpo.choices"):
        POLICY_LOSS_FUNCTIONS.of("ppo")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="KL estimator 'k3' already has a function"):
        KL_FUNCTIONS.of("k3")(lambda logp, ref: logp - ref)


# ------------------------------------------------------------------ KL and entropy


def test_kl_estimators():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-2.0, -1.0, -0.5]])
    # d = ref - logp = [-1, 1, 0]
    close(compute_kl(logp, ref, "k1"), [[1.0, -1.0, 0.0]])  # logp - ref
    close(compute_kl(logp, ref, "k2"), [[0.5, 0.5, 0.0]])  # ½·(±1)²
    # k3 = e^d - d - 1: e^-1 + 1 - 1 = .367879; e^1 - 1 - 1 = .718282; e^0 - 0 - 1 = 0
    close(compute_kl(logp, ref, "k3"), [[0.367879, 0.718282, 0.0]])
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        compute_kl(logp, ref, "k4")
    with pytest.raises(ValueError, match="ref_log_probs has shape"):
        compute_kl(logp, ref[:, :2], "k3")


def test_kl_estimators_have_the_properties_they_register():
    # Tokens drawn from pi = [.5, .3, .2] against pi_ref = [.2, .3, .5]: the exact
    # KL(pi || pi_ref) = .5 ln 2.5 + .2 ln .4 = .458145 - .183258 = .274887.
    pi, ref = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5])
    tokens = torch.multinomial(pi, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    logp, ref_logp = pi.log()[tokens].unsqueeze(0), ref.log()[tokens].unsqueeze(0)
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}
    for name, est in KL_ESTIMATORS.items():
        values = compute_kl(logp, ref_logp, name)
        assert (values.min() >= 0) == est.nonnegative, name
        assert (abs(values.mean().item() - 0.274887) < 0.005) == est.unbiased, (name, values.mean())
    with pytest.raises(ValueError, match="already registered"):
        register_kl_estimator("k3", unbiased=True, nonnegative=True)(lambda logp, ref: logp - ref)


def test_entropy_hand_values_and_stability():
    logits = torch.tensor(
        [
            [[0.0, 0.0, -1e9, float("-inf")], [0.0, 0.0, 0.0, 0.0]],
            [[0.0, math.log(3.0), -1e9, -1e9], [1000.0, 1000.0, 0.0, -1000.0]],
        ]
    )
    # [0,0,-1e9,-inf]: uniform over 2 → ln 2 = .693147; uniform over 4 → ln 4 = 1.386294
    # [0, ln3]: p = [¼, ¾] → -(¼ ln ¼ + ¾ ln ¾) = .346574 + .215762 = .562335
    # [1000, 1000, 0, -1000]: ≈ uniform over the two 1000s → ln 2 (naive exp would overflow)
    out = compute_entropy(logits)
    assert out.shape == (2, 2)
    close(out, [[0.693147, 1.386294], [0.562335, 0.693147]])


def test_entropy_matches_explicit_softmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=gen, dtype=torch.float64) * 3
    exp = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
    probs = exp / exp.sum(dim=-1, keepdim=True)
    explicit = -(probs * torch.log(probs)).sum(dim=-1)
    torch.testing.assert_close(compute_entropy(logits), explicit, atol=1e-10, rtol=0)


# ------------------------------------------------------------------ masked reductions


def test_masked_mean_and_normalize():
    t = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, float("inf")]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    close(masked_mean(t, mask), 1.5)  # (1+2)/2; the inf is masked out
    close(masked_mean(t, mask, dim=1), [1.5, 0.0])  # row 1 has no tokens → 0
    close(masked_mean(t, mask, dim=0), [1.0, 2.0, 0.0])
    close(masked_normalize(t, mask, 2.0), 1.5)  # (1+2)/2
    close(masked_normalize(t, mask, 2.0, dim=1), [1.5, 0.0])
    close(masked_normalize(t, mask, 4.0, dim=0), [0.25, 0.5, 0.0])
    # bool masks work too
    close(masked_mean(t, mask.bool(), dim=1), [1.5, 0.0])


def test_masked_reductions_all_zero_mask_no_nan():
    t = torch.tensor([[1.0, 2.0]], requires_grad=True)
    zero = torch.zeros(1, 2)
    m = masked_mean(t, zero)
    assert m.item() == 0.0
    m.backward()
    assert torch.isfinite(t.grad).all() and t.grad.abs().sum() == 0
    assert masked_normalize(t, zero, 3.0).item() == 0.0
    close(masked_mean(t, zero, dim=1), [0.0])
    with pytest.raises(ValueError, match="normalize_constant"):
        masked_normalize(t, zero, 0.0)


# ------------------------------------------------------------------ aggregation

# Four rows: (row sum over mask, tokens) = (6, 3), (10, 1), (20, 2), (0, 0).
PER_TOKEN = torch.tensor(
    [[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 0.0, 0.0], [5.0, 15.0, 9.0, 9.0], [7.0, 7.0, 7.0, 7.0]]
)
MASK = torch.tensor(
    [[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
)


def test_aggregation_modes_whole_batch():
    # sequence: row means 6/3=2, 10/1=10, 20/2=10, 0 (no tokens) → (2+10+10+0)/4 = 5.5
    close(aggregate_loss(PER_TOKEN, MASK, "sequence"), 5.5)
    # token: (6+10+20+0)/(3+1+2+0) = 36/6 = 6
    close(aggregate_loss(PER_TOKEN, MASK, "token"), 6.0)
    # constant (Dr. GRPO), C = 4: 36/(4 rows · 4) = 2.25
    close(aggregate_loss(PER_TOKEN, MASK, "constant", constant_normalizer=4), 2.25)
    with pytest.raises(ValueError, match="constant_normalizer"):
        aggregate_loss(PER_TOKEN, MASK, "constant")
    with pytest.raises(ValueError, match="unknown aggregation 'mean'.*sequence"):
        aggregate_loss(PER_TOKEN, MASK, "mean")
    with pytest.raises(ValueError, match="num_tokens_total"):
        aggregate_loss(PER_TOKEN, MASK, "token", num_micro_batches=2)


def test_token_aggregation_over_micro_batches_matches_whole_batch():
    # micro 1 = rows 0,1: sum 16, 4 tokens; micro 2 = rows 2,3: sum 20, 2 tokens; 6 tokens total.
    # Convention: L_i = sum_i · n / N_total → 16·2/6 = 5.333333, 20·2/6 = 6.666667;
    # engine: (5.333333 + 6.666667)/2 = 6 = whole-batch token mean (36/6).
    # (Per-micro-batch token means would give (16/4 + 20/2)/2 = 7, not 6.)
    x = PER_TOKEN.clone().requires_grad_(True)
    parts = [
        aggregate_loss(x[sl], MASK[sl], "token", num_tokens_total=6, num_micro_batches=2)
        for sl in (slice(0, 2), slice(2, 4))
    ]
    close(parts[0], 16 * 2 / 6)
    close(parts[1], 20 * 2 / 6)
    engine_loss = sum(p / 2 for p in parts)
    close(engine_loss, 6.0)
    # same gradient as the whole batch: mask / 6 on every token
    engine_loss.backward()
    close(x.grad, MASK / 6)


def test_sequence_and_constant_over_equal_micro_batches_match_whole_batch():
    halves = (slice(0, 2), slice(2, 4))
    # sequence: micro means (2+10)/2 = 6 and (10+0)/2 = 5 → (6+5)/2 = 5.5
    seq = [aggregate_loss(PER_TOKEN[s], MASK[s], "sequence") for s in halves]
    close(seq[0], 6.0)
    close(sum(seq) / 2, 5.5)
    # constant C = 4: 16/(2·4) = 2, 20/(2·4) = 2.5 → 2.25
    const = [
        aggregate_loss(PER_TOKEN[s], MASK[s], "constant", constant_normalizer=4) for s in halves
    ]
    close(const[1], 2.5)
    close(sum(const) / 2, 2.25)


def test_aggregation_empty_mask_is_zero_and_differentiable():
    x = PER_TOKEN.clone().requires_grad_(True)
    zero = torch.zeros_like(MASK)
    for mode, kw in (
        ("sequence", {}),
        ("token", {}),
        ("token", {"num_tokens_total": 0, "num_micro_batches": 2}),
        ("constant", {"constant_normalizer": 8}),
    ):
        out = aggregate_loss(x, zero, mode, **kw)
        assert out.item() == 0.0
        out.backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() == 0


# ------------------------------------------------------------------ policy_loss


def test_policy_loss_grpo_clip_with_kl_token_aggregation():
    adv = torch.tensor([1.0, -1.0])
    # ratios: row 0 [1.5, .5, 3.0 (masked out)], row 1 [1.5, .5, .9]
    logp, old = _ratio_inputs([[1.5, 0.5, 3.0], [1.5, 0.5, 0.9]])
    logp.requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # ref - logp = ln 2 at row 0 token 0, else 0 → k3 = 2 - ln 2 - 1 = .306853 there, else 0
    ref = logp.detach().clone()
    ref[0, 0] += LN2
    loss, metrics = policy_loss(
        logp, mask, loss_type="grpo_clip", advantages=adv, old_log_probs=old, ref_log_probs=ref,
        cliprange=0.2, kl_coef=0.1, kl_estimator="k3", aggregation="token",
    )
    # pg per token (see the clip test): row 0 [-1.2, -.5, ·], row 1 [1.5, .8, .9]
    # pg sum over the 5 response tokens = -1.2 - .5 + 1.5 + .8 + .9 = 1.5
    # loss = (1.5 + .1·.306853)/5 = .306137
    close(loss, 0.306137)
    assert set(metrics) == set(POLICY_LOSS_METRIC_KEYS)
    close(metrics["pg_loss"], 0.3)  # 1.5/5
    close(metrics["kl"], 0.061371)  # .306853/5
    close(metrics["clip_fraction"], 0.4)  # clipped: row0 tok0, row1 tok1 → 2/5
    close(metrics["ratio_mean"], 0.98)  # (1.5+.5+1.5+.5+.9)/5 = 4.9/5
    close(metrics["ratio_max"], 1.5)  # the 3.0 is outside the mask
    assert all(not v.requires_grad and v.dtype == torch.float32 for v in metrics.values())
    loss.backward()
    # gradient: pg part -ρA/5 where unclipped, plus .1·d(k3)/dlogp/5 = .1·(1 - e^d)/5 with
    # d = ref - logp held fixed: at row 0 tok 0 the pg term is clipped → .1·(1 - 2)/5 = -.02
    # row 0 tok 1: -(.5)(1)/5 = -.1; row 1: 1.5/5 = .3, clipped 0, .9/5 = .18; masked → 0
    close(logp.grad, [[-0.02, -0.1, 0.0], [0.3, 0.0, 0.18]])


def test_policy_loss_metric_keys_fixed_for_every_loss_type():
    logp, old = _ratio_inputs([[1.5, 0.5], [1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    common = dict(
        advantages=torch.tensor([1.0, -1.0]), raw_rewards=torch.tensor([1.0, 0.0]),
        old_log_probs=old, cliprange=0.2, cliprange_high=0.28,
    )
    for loss_type in ("no_baseline", "reinforce_with_baseline", "grpo_clip", "dapo", "gspo"):
        _, metrics = policy_loss(logp, mask, loss_type=loss_type, **common)
        assert tuple(metrics) == POLICY_LOSS_METRIC_KEYS, loss_type
        assert metrics["kl"].item() == 0.0  # no reference given
    # a non-clip loss without old log-probs is on-policy: ratio 1, nothing clipped
    _, metrics = policy_loss(
        logp, mask, loss_type="reinforce_with_baseline", advantages=torch.tensor([1.0, -1.0])
    )
    assert metrics["clip_fraction"].item() == 0.0
    assert metrics["ratio_mean"].item() == 1.0 and metrics["ratio_max"].item() == 1.0
    # ... and with old log-probs it reports the real ratio: (1.5 + .5 + 1)/3 = 1
    _, metrics = policy_loss(logp, mask, loss_type="reinforce_with_baseline", **common)
    close(metrics["ratio_mean"], 1.0)
    close(metrics["ratio_max"], 1.5)


def test_policy_loss_sequence_default_and_kl_monitoring():
    # reinforce, A = [1, -1], logp = [[-1, -3], [-2, -4]], mask row 1 only first token
    logp = torch.tensor([[-1.0, -3.0], [-2.0, -4.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    ref = logp + torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # k1 = logp - ref = -1 at [0, 0]
    loss, metrics = policy_loss(
        logp, mask, loss_type="reinforce_with_baseline", advantages=torch.tensor([1.0, -1.0]),
        ref_log_probs=ref, kl_coef=0.0, kl_estimator="k1",
    )
    # per token -A·logp: row 0 [1, 3] → mean 2; row 1 [-2] → -2; batch mean 0;
    # kl_coef 0 adds nothing
    close(loss, 0.0)
    close(metrics["pg_loss"], 0.0)
    close(metrics["kl"], -1 / 3)  # still reported: (-1 + 0 + 0)/3
    with pytest.raises(ValueError, match="kl_coef > 0 requires ref_log_probs"):
        policy_loss(logp, mask, loss_type="reinforce_with_baseline",
                    advantages=torch.tensor([1.0, -1.0]), kl_coef=0.1)
    with pytest.raises(ValueError, match="response_mask has shape"):
        policy_loss(logp, mask[:, :1], loss_type="reinforce_with_baseline",
                    advantages=torch.tensor([1.0, -1.0]))


def test_policy_loss_empty_mask_is_finite():
    logp, old = _ratio_inputs([[1.5, 0.5]])
    logp.requires_grad_(True)
    loss, metrics = policy_loss(
        logp, torch.zeros(1, 2), loss_type="grpo_clip", advantages=torch.tensor([1.0]),
        old_log_probs=old, cliprange=0.2, aggregation="token",
    )
    assert loss.item() == 0.0
    assert all(v.item() == 0.0 for v in metrics.values())
    loss.backward()
    assert torch.isfinite(logp.grad).all()
