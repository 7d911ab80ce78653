"""The modes as records: aggregation, overlong handling, rollout IS correction and the old log-probs'
source each carry their properties in `rlft.grpo.choices`, with their functions attached where the maths
lives.  A choice registered here, by a test, with no other file touched, is accepted by the config and
used by the code that runs it (numbers worked by hand); the checks read its properties, not its name."""
from __future__ import annotations

import math
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from rlft.batching.batch import Labels
from rlft.config import ConfigError, build_config, config_warnings, load_config
from rlft.grpo import (
    AGGREGATION_MODES,
    OLD_LOGPROB_SOURCES,
    OVERLONG_MODES,
    ROLLOUT_IS_MODES,
    aggregate_loss,
    register_aggregation,
    register_rollout_is,
)
from rlft.objectives import GRPOObjective


def close(got, want, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float32),
                               torch.as_tensor(want, dtype=torch.float32), atol=tol, rtol=0)


@contextmanager
def registered(functions, name):
    """The choice `name` just registered into `functions` (an `Implementations`), removed afterwards."""
    try:
        yield
    finally:
        functions.records.pop(name, None)
        functions.pop(name, None)


def test_the_builtin_records_carry_their_properties():
    assert {n: m.fixed_length for n, m in AGGREGATION_MODES.items()} == \
        {"sequence": False, "token": False, "constant": True}
    assert {n: (m.changes_rewards, m.masks_rows, m.uses) for n, m in OVERLONG_MODES.items()} == {
        "none": (False, False, ()), "filter": (False, True, ()),
        "soft_penalty": (True, False, ("overlong_buffer", "overlong_penalty"))}
    assert {n: m.reads_sampler_logprobs for n, m in ROLLOUT_IS_MODES.items()} == {"none": False, "tis": True}
    assert {n: (s.needs_reference, s.recomputed) for n, s in OLD_LOGPROB_SOURCES.items()} == {
        "policy": (False, True), "reference": (True, False)}


def test_every_recorded_mode_has_its_function():
    from rlft.batching.overlong import OVERLONG_FUNCTIONS
    from rlft.grpo.reductions import AGGREGATION_FUNCTIONS
    from rlft.grpo.rollout_correction import ROLLOUT_IS_FUNCTIONS
    from rlft.objectives import OLD_LOGPROB_FUNCTIONS

    for functions in (AGGREGATION_FUNCTIONS, OVERLONG_FUNCTIONS, ROLLOUT_IS_FUNCTIONS, OLD_LOGPROB_FUNCTIONS):
        assert set(functions.records) == set(functions), functions.kind
    with pytest.raises(ValueError, match="aggregation 'mean' has no record in rlft.grpo.choices"):
        AGGREGATION_FUNCTIONS.of("mean")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="overlong mode 'filter' already has a function"):
        OVERLONG_FUNCTIONS.of("filter")(lambda *a: None)
    with pytest.raises(ValueError, match="already registered"):
        register_rollout_is("tis", reads_sampler_logprobs=True)(lambda *a: None)
    for key, valid in (("grpo.aggregation", "sequence, token, constant"), ("grpo.overlong", "none, filter, soft_penalty"),
                       ("grpo.rollout_is", "none, tis"), ("grpo.old_logprobs", "policy, reference")):
        with pytest.raises(ConfigError, match=f"{key}: must be one of {valid}, got 'no_such_mode'"):
            load_config(None, [f"{key}=no_such_mode"])


# ---------------------------------------------------------------- aggregation

# Rows' masked tokens: [1, 2, 3], [10], [5, 15], none.
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 0.0, 0.0], [5.0, 15.0, 9.0, 9.0], [7.0, 7.0, 7.0, 7.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_a_registered_aggregation_is_accepted_and_used():
    from rlft.grpo.reductions import AGGREGATION_FUNCTIONS

    @register_aggregation("max_token")
    def _max_token(per_token_loss, mask, *, rows, **_):
        """Each row's largest response-token loss (0 without tokens), summed, ÷ the rows."""
        top = per_token_loss.masked_fill(mask == 0, float("-inf")).amax(dim=-1)
        return torch.where(mask.sum(-1) > 0, top, torch.zeros_like(top)).sum() / rows

    with registered(AGGREGATION_FUNCTIONS, "max_token"):
        # Row maxima 3, 10, 15 and 0 (no tokens) over 4 rows: 28 / 4 = 7.
        close(aggregate_loss(PER_TOKEN, MASK, "max_token"), 7.0)
        # Micro-batches of unequal rows divide by the whole batch's rows: (3 + 10 + 15) / 4 per mb * 2 mbs.
        close(aggregate_loss(PER_TOKEN[:3], MASK[:3], "max_token", num_rows_total=4, num_micro_batches=2), 14.0)
        g = load_config(None, ["grpo.aggregation=max_token", "grpo.loss_type=reinforce_with_baseline"]).grpo
        assert g.aggregation == "max_token"
        # -A·logp with A = [1, -1]: row 0 [1, 2], row 1 [-.5, -3]; maxima 2 and -.5 -> mean .75.
        logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
        labels = Labels(response_mask=torch.ones(2, 2), advantages=torch.tensor([1.0, -1.0]),
                        raw_rewards=torch.tensor([1.0, 0.0]))
        loss, metrics = GRPOObjective(g, max_tokens=8).loss(logp, torch.zeros(2, 2), labels, num_tokens_total=4.0,
                                                            num_micro_batches=1)
        close(loss, 0.75)
        close(metrics["pg_loss"], 0.75)
    with pytest.raises(ConfigError, match="grpo.aggregation: must be one of sequence, token, constant, got 'max_token'"):
        load_config(None, ["grpo.aggregation=max_token"])


def test_an_aggregation_recorded_as_fixed_length_gets_the_objectives_length():
    from rlft.grpo.reductions import AGGREGATION_FUNCTIONS, masked_normalize

    @register_aggregation("_test_per_length", fixed_length=True)
    def _per_length(per_token_loss, mask, *, constant_normalizer, **_):
        """The tokens' sum ÷ the fixed length alone (not times the rows)."""
        return masked_normalize(per_token_loss, mask, constant_normalizer)

    with registered(AGGREGATION_FUNCTIONS, "_test_per_length"):
        with pytest.raises(ValueError, match="aggregation '_test_per_length' needs a positive constant_normalizer"):
            aggregate_loss(PER_TOKEN, MASK, "_test_per_length")
        close(aggregate_loss(PER_TOKEN, MASK, "_test_per_length", constant_normalizer=9), 36 / 9)
        g = build_config({"grpo": {"aggregation": "_test_per_length", "loss_type": "reinforce_with_baseline"}}).grpo
        logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
        labels = Labels(response_mask=torch.ones(2, 2), advantages=torch.tensor([1.0, -1.0]),
                        raw_rewards=torch.tensor([1.0, 0.0]))
        # Sum of -A·logp = 1 + 2 - .5 - 3 = -.5, ÷ max_tokens 5 = -.1.
        loss, _ = GRPOObjective(g, max_tokens=5).loss(logp, torch.zeros(2, 2), labels, num_tokens_total=4.0,
                                                      num_micro_batches=1)
        close(loss, -0.1)


# ---------------------------------------------------------------- a loss with a setting of its own


def test_a_loss_with_an_option_of_its_own_reads_it_from_grpo_loss_options():
    from rlft.grpo import POLICY_LOSSES, register_policy_loss
    from rlft.grpo.losses import POLICY_LOSS_FUNCTIONS

    @register_policy_loss("_test_scaled_reinforce", uses_ratio=False)
    def _scaled(policy_log_probs, *, advantages, scale=1.0, **_):
        """-scale · A · logp: its option `scale`, a keyword with a default, is read from its signature."""
        return -scale * advantages * policy_log_probs, {}

    with registered(POLICY_LOSS_FUNCTIONS, "_test_scaled_reinforce"):
        assert POLICY_LOSSES["_test_scaled_reinforce"].options == ("scale",)
        logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
        labels = Labels(response_mask=torch.ones(2, 2), advantages=torch.tensor([1.0, -1.0]),
                        raw_rewards=torch.tensor([1.0, 0.0]))

        def loss_of(*overrides):
            g = load_config(None, ["grpo.loss_type=_test_scaled_reinforce", *overrides]).grpo
            return GRPOObjective(g, max_tokens=8).loss(logp, torch.zeros(2, 2), labels, num_tokens_total=4.0,
                                                       num_micro_batches=1)[0]

        # -A·logp: row 0 [1, 2] (mean 1.5), row 1 [-.5, -3] (mean -1.75); the rows' mean -.125, x scale.
        close(loss_of(), -0.125)  # no options: the function's default, 1
        close(loss_of("grpo.loss_options.scale=3"), -0.375)
        assert load_config(None, ["grpo.loss_type=_test_scaled_reinforce",
                                  "grpo.loss_options.scale=3"]).grpo.loss_options == {"scale": 3}
        with pytest.raises(ConfigError) as info:
            load_config(None, ["grpo.loss_type=_test_scaled_reinforce", "grpo.loss_options.scael=3"])
        assert str(info.value) == ("grpo.loss_options.scael: loss_type _test_scaled_reinforce takes no option "
                                   "scael (its options: scale)")
    with pytest.raises(ConfigError) as info:  # rlft's own losses take none
        load_config(None, ["grpo.loss_options.scale=3"])
    assert str(info.value) == "grpo.loss_options.scale: loss_type grpo_clip takes no option scale (its options: none)"
    assert load_config(None, []).grpo.loss_options == {}
    with pytest.raises(ValueError, match=r"^policy loss '_test_bare': option scale needs a default"):
        register_policy_loss("_test_bare", uses_ratio=False)(lambda policy_log_probs, *, scale, **_: None)
    assert "_test_bare" not in POLICY_LOSSES


# ---------------------------------------------------------------- rollout IS correction

# The trainer's and the sampler's log-probs differ by ratios 2 and .25 on one row of two tokens.
TRAINER = torch.tensor([[-1.0, -2.0]])
SAMPLER = TRAINER - torch.log(torch.tensor([[2.0, 0.25]]))


def one_row_labels(**more) -> Labels:
    return Labels(response_mask=torch.ones(1, 2), advantages=torch.tensor([1.0]), raw_rewards=torch.tensor([1.0]),
                  sampler_logprobs=SAMPLER, **more)


def test_a_registered_rollout_correction_is_accepted_and_weighs_the_loss():
    from rlft.grpo.rollout_correction import ROLLOUT_IS_FUNCTIONS

    @register_rollout_is("_test_untruncated", reads_sampler_logprobs=True)
    def _untruncated(trainer_log_probs, sampler_log_probs, cap):
        """Plain importance weights π_trainer / π_sampler, not truncated."""
        return torch.exp(trainer_log_probs - sampler_log_probs)

    with registered(ROLLOUT_IS_FUNCTIONS, "_test_untruncated"):
        overrides = ["grpo.loss_type=reinforce_with_baseline", "grpo.rollout_is_cap=1.5"]
        g = load_config(None, ["grpo.rollout_is=_test_untruncated", *overrides]).grpo
        # Its record says the loss reads the sampler's log-probs: every step asks the engine for them.
        assert g.loss_reads_sampler_logprobs(max_staleness=0)
        assert all(g.wants_sampler_logprobs(step, 0) for step in range(1, 12))
        objective = GRPOObjective(g, max_tokens=2)
        assert objective.optional_label_fields == ()
        # -A·logp = [1, 2]; weights [2, .25] -> [2, .5], sequence mean 1.25.
        loss, _ = objective.loss(TRAINER.clone(), torch.zeros(1, 2), one_row_labels(), num_tokens_total=2.0,
                                 num_micro_batches=1)
        close(loss, 1.25)
        # For comparison: tis with the cap 1.5 weighs [1.5, .25] -> [1.5, .5], mean 1; none: mean 1.5.
        for mode, want in (("tis", 1.0), ("none", 1.5)):
            other = GRPOObjective(load_config(None, [f"grpo.rollout_is={mode}", *overrides]).grpo, max_tokens=2)
            close(other.loss(TRAINER.clone(), torch.zeros(1, 2), one_row_labels(), num_tokens_total=2.0,
                             num_micro_batches=1)[0], want)
        # Staleness without a ratio is warned about unless the correction reads the sampler's log-probs.
        stale = ["schedule.max_staleness=1", *overrides]
        assert not any("no importance ratio" in w
                       for w in config_warnings(load_config(None, ["grpo.rollout_is=_test_untruncated", *stale])))
        assert any("no importance ratio" in w for w in config_warnings(load_config(None, stale)))


# ---------------------------------------------------------------- old log-probs' source


def test_a_registered_old_logprobs_source_is_accepted_and_is_the_ratios_denominator():
    from rlft.objectives import OLD_LOGPROB_FUNCTIONS, register_old_logprob_source

    @register_old_logprob_source("_test_halfway", needs_reference=True, recomputed=False)
    def _halfway(logp, labels, g, *, off_policy):
        """Halfway (in log space) between the current policy and the reference."""
        return (logp.detach() + labels.ref_logprobs) / 2

    with registered(OLD_LOGPROB_FUNCTIONS, "_test_halfway"):
        g = load_config(None, ["grpo.old_logprobs=_test_halfway", "grpo.epochs_per_rollout=2",
                               "grpo.cliprange=10"]).grpo
        # Its record: the reference's log-probs are needed (with kl_coef 0), nothing is recomputed.
        assert (g.kl_coef, g.needs_reference, g.recomputes_old_logprobs) == (0.0, True, False)
        objective = GRPOObjective(g, max_tokens=2)
        assert "ref_logprobs" in objective.label_fields and "old_logprobs" not in objective.label_fields
        assert objective.needs_reference and not objective.needs_old_logprobs
        # logp - ref = [2 ln 2, 0]: old = logp - [ln 2, 0], ratio [2, 1]; grpo_clip, A = 1, nothing
        # clipped (range ±10): -[2, 1], sequence mean -1.5.
        ref = TRAINER - torch.tensor([[2 * math.log(2.0), 0.0]])
        loss, metrics = objective.loss(TRAINER.clone(), torch.zeros(1, 2), one_row_labels(ref_logprobs=ref),
                                       num_tokens_total=2.0, num_micro_batches=1)
        close(loss, -1.5)
        close(metrics["ratio_mean"], 1.5)
        close(metrics["ratio_max"], 2.0)


# ---------------------------------------------------------------- overlong modes

PAD, BOS, EOS = 0, 1, 2


def overlong_worker(**grpo):
    """The rollout role's batch-building half, without an engine, data or grader."""
    from rlft.roles.rollout import RolloutWorker

    cfg = build_config({"grpo": {"group_size": 4, "advantage_estimator": "dr_grpo", **grpo},
                        "sampling": {"max_tokens": 10}, "optim": {"rollout_batch_size": 4}})
    w = RolloutWorker.__new__(RolloutWorker)
    w.cfg, w.group_size = cfg, 4
    w.tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
    return w


def test_a_registered_overlong_mode_changes_rewards_and_masks_rows_as_its_record_says():
    from rlft.batching.overlong import OVERLONG_FUNCTIONS, OverlongOutcome, register_overlong_mode, truncated_rows
    from conftest import rollout_rows

    @register_overlong_mode("_test_step_penalty", changes_rewards=True, masks_rows=True,
                            uses=("overlong_buffer", "overlong_penalty"))
    def _step(lengths, finish_reasons, max_tokens, g):
        """-overlong_penalty for every response longer than max_tokens - overlong_buffer; the cut ones
        out of the loss."""
        change = torch.where(lengths > max_tokens - g.overlong_buffer, -g.overlong_penalty, 0.0)
        return OverlongOutcome(reward_change=change, masked_rows=truncated_rows(finish_reasons),
                               metrics={"overlong/stepped": float((change < 0).sum())})

    lengths = [5, 6, 8, 10]  # the last cut by max_tokens = 10
    rollout = rollout_rows([[7, 8]] * 4, [[3 + i] * n for i, n in enumerate(lengths)],
                           ["stop", "eos", "stop", "length"], logprobs=[[-0.5] * n for n in lengths])
    grades = [{"reward": r, "format_reward": 1.0, "answer_reward": r} for r in (1.0, 0.0, 1.0, 1.0)]
    with registered(OVERLONG_FUNCTIONS, "_test_step_penalty"):
        w = overlong_worker(overlong="_test_step_penalty", overlong_buffer=4, overlong_penalty=0.5)
        batch, stats = w.to_batch(rollout, grades)
        # Longer than 10 - 4 = 6: the rows of 8 and 10 tokens. Rewards 1, 0, .5, .5; mean .5.
        assert batch.raw_rewards.tolist() == [1.0, 0.0, 0.5, 0.5]
        assert batch.advantages.tolist() == [0.5, -0.5, 0.0, 0.0]
        assert stats["reward_mean"] == 0.5
        assert w.filter_overlong(batch, rollout) == {"overlong/stepped": 2.0}
        assert batch.response_mask.sum(-1).tolist() == [5.0, 6.0, 8.0, 0.0]
        # The checks read the settings it uses: its buffer must fit max_tokens, as soft_penalty's.
        with pytest.raises(ConfigError, match=r"grpo.overlong_buffer: must be between 1 and sampling.max_tokens \(10\)"):
            overlong_worker(overlong="_test_step_penalty", overlong_buffer=11)
        assert overlong_worker(overlong="filter", overlong_buffer=11).cfg.grpo.overlong == "filter"


# ---------------------------------------------------------------- launchers (rlft.config.launchers)


def test_the_builtin_launchers_carry_their_properties():
    from rlft.config.launchers import LAUNCHERS

    props = lambda l: (l.needs_hostfile, l.uses_ssh, l.per_node_launch, l.starts_ranks, l.starts_every_slot,
                       l.runs_modules)
    assert {name: props(l) for name, l in LAUNCHERS.items()} == {
        "pdsh": (True, True, False, False, False, True),
        "slurm": (True, False, False, True, False, False),
        **{mpi: (True, False, False, True, True, True) for mpi in ("openmpi", "mpich", "impi", "mvapich")},
        "no_ssh": (True, False, True, False, False, True)}


def test_registered_launchers_are_accepted_and_planned_by_their_properties(tmp_path, monkeypatch):
    from pathlib import Path

    from rlft.config.launch_plan import make_plan
    from rlft.config.launchers import LAUNCHER_ARGS, register_launcher

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)  # the config names its hostfile relative to the checkout
    two_by_eight = repo / "launch" / "configs" / "grpo_2x8gpu.yaml"

    @register_launcher("_test_per_node", needs_hostfile=False, per_node_launch=True)
    def _per_node(n):
        return ["--node_rank", str(n.topology.node_rank), "--master_addr", n.master_addr]

    @register_launcher("_test_srun", starts_ranks=True, runs_modules=False)
    def _srun(n):
        return ["--launcher", "slurm", "--master_addr", n.master_addr, *n.launcher_args("--exclusive")]

    with registered(LAUNCHER_ARGS, "_test_per_node"), registered(LAUNCHER_ARGS, "_test_srun"):
        # A per-node launcher needs node 0's address (the config's check) and this node's rank (the plan's).
        with pytest.raises(ConfigError, match=r"^topology.master_addr: required with topology.launcher=_test_per_node"):
            load_config(two_by_eight, ["topology.launcher=_test_per_node"])
        per_node = ["topology.launcher=_test_per_node", "topology.master_addr=10.0.0.1"]
        with pytest.raises(ConfigError, match=r"^topology.node_rank: required with topology.launcher=_test_per_node; "
                                              r"start one launch on every node with topology.node_rank=0 .. 1$"):
            make_plan(load_config(two_by_eight, per_node), 8)
        # It reads no hostfile: none is passed, none is needed.
        plan = make_plan(load_config(two_by_eight, [*per_node, "topology.node_rank=1", "output.hostfile=null"]), 8)
        assert plan.ds_args == ["--master_port", "29500", "--node_rank", "1", "--master_addr", "10.0.0.1"]
        assert (plan.entry, plan.rank_args) == ("module", [])
        # One that starts the ranks itself and cannot run modules: the ranks get the master address
        # (the hostfile's first host) and port; the entry is the script; a larger hostfile is fine.
        hostfile = tmp_path / "hosts"
        hostfile.write_text("a slots=8\nb slots=8\nc slots=8\n")
        plan = make_plan(load_config(two_by_eight, ["topology.launcher=_test_srun", f"output.hostfile={hostfile}",
                                                    "topology.launcher_args=--time=10"]), 8)
        assert plan.ds_args == ["--hostfile", str(hostfile), "--master_port", "29500", "--launcher", "slurm",
                                "--master_addr", "a", "--launcher_args=--exclusive --time=10"]
        assert (plan.entry, plan.rank_args) == ("script", ["topology.master_addr=a", "topology.master_port=29500"])
    with pytest.raises(ConfigError, match="topology.launcher: must be one of pdsh, slurm, openmpi, mpich, impi, "
                                          "mvapich, no_ssh, got '_test_srun'"):
        load_config(two_by_eight, ["topology.launcher=_test_srun"])


# ---------------------------------------------------------------- the loss's record, read by the preflight too


def test_preflight_and_config_checks_read_the_same_loss_record():
    from rlft.config.preflight import check_grpo_can_learn
    from rlft.grpo import POLICY_LOSSES, register_policy_loss
    from rlft.grpo.losses import POLICY_LOSS_FUNCTIONS

    register_policy_loss("_test_raw_rewards", uses_ratio=False, uses_groups=False)(
        lambda policy_log_probs, *, raw_rewards, **_: (-raw_rewards * policy_log_probs, {}))
    register_policy_loss("_test_grouped", uses_ratio=False)(
        lambda policy_log_probs, *, advantages, **_: (-advantages * policy_log_probs, {}))
    with registered(POLICY_LOSS_FUNCTIONS, "_test_raw_rewards"), registered(POLICY_LOSS_FUNCTIONS, "_test_grouped"):
        # A loss without groups: the config wants group_size 1, and the preflight lets it learn.
        check_grpo_can_learn(load_config(None, ["grpo.loss_type=_test_raw_rewards", "grpo.group_size=1"]))
        with pytest.raises(ConfigError, match="grpo.group_size: loss_type _test_raw_rewards uses no groups"):
            load_config(None, ["grpo.loss_type=_test_raw_rewards", "grpo.group_size=4"])
        # A loss with groups: a group of one is refused, naming the losses that need none.
        with pytest.raises(ConfigError) as info:
            check_grpo_can_learn(load_config(None, ["grpo.loss_type=_test_grouped", "grpo.group_size=1"]))
        assert str(info.value).startswith("grpo.group_size: 1 with grpo.loss_type _test_grouped: the advantage is")
        assert str(info.value).endswith("(or grpo.loss_type=no_baseline or _test_raw_rewards)")
    assert "_test_raw_rewards" not in POLICY_LOSSES
