"""Micro-batches by a token budget (`optim.micro_batch_tokens`): the cut itself, and, through the real
2-stage DeepSpeed pipeline of `PolicyTrainer` (CPU, gloo, fp32), the same loss, gradients and
mismatch metrics as fixed-size micro-batches for every aggregation."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from rlft.common import free_port
from rlft.batching.micro_batches import fixed_micro_batches, padded_tokens, row_widths, token_budget_micro_batches


def test_row_widths_count_left_padding_and_stop_at_the_last_token():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert row_widths(mask).tolist() == [3, 5, 2]  # at least 2: one label column remains


def test_token_budget_groups_similar_lengths_within_the_budget():
    widths = torch.tensor([10, 3, 9, 2, 4, 10, 3, 25])
    plan = token_budget_micro_batches(widths, max_tokens=20)
    assert [g.tolist() for g in plan] == [[7], [0, 5], [2, 4], [1, 6, 3]]
    # every row once; within the budget but for the row wider than it
    assert sorted(torch.cat(plan).tolist()) == list(range(8))
    assert all(len(g) * int(widths[g].max()) <= 20 for g in plan[1:])
    # less padding than 2 rows at a time in their order: 4 x 2 rows of widths (10,3)(9,2)(4,10)(3,25)
    fixed = fixed_micro_batches(8, 2)
    assert padded_tokens(widths, fixed) == 2 * (10 + 9 + 10 + 25)
    assert padded_tokens(widths, plan) == 25 + 20 + 18 + 9 < padded_tokens(widths, fixed)
    with pytest.raises(ValueError, match="max_tokens"):
        token_budget_micro_batches(widths, 0)


# ------------------------------------------------------------------ through the pipeline

ROWS = 8
# (name, micro_batch_tokens): 0 = the fixed cut of 2 rows in order
CUTS = (("fixed", 0), ("budget_small", 40), ("budget_large", 200))
AGGREGATIONS = ("sequence", "token", "constant")


def _batch():
    from rlft.batching.batch import build_rollout_batch

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 300, (int(n),), generator=g).tolist() for n in torch.randint(2, 7, (ROWS,), generator=g)]
    responses = [torch.randint(5, 300, (int(n),), generator=g).tolist() for n in (1, 12, 3, 9, 2, 7, 11, 4)]
    batch = build_rollout_batch(prompts, responses, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                                response_logprobs=[(-torch.rand(len(r), generator=g) * 3).tolist() for r in responses])
    batch.advantages = torch.randn(ROWS, generator=g)
    batch.raw_rewards = batch.advantages.clone()
    batch.ref_logprobs = -torch.rand(batch.response_mask.shape, generator=g) * 3
    return batch


def _pipeline_worker(rank: int, port: int, model_dir: str, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import deepspeed

    from rlft.config import build_config
    from rlft.objectives import GRPOObjective
    from rlft.roles.policy import PolicyTrainer
    from rlft.runtime.bridge import skip_cpu_shm_comm_build
    from rlft.config.topology import RankRoles

    skip_cpu_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    cfg = build_config({"model": {"path": model_dir}, "sampling": {"max_tokens": 12},
                        "grpo": {"group_size": 2, "loss_type": "dapo", "cliprange_high": 0.28, "kl_coef": 0.05,
                                 "rollout_is": "tis"},
                        "optim": {"rollout_batch_size": ROWS, "train_micro_batch_size": 2}})
    roles = RankRoles(rank=rank, world_size=2, policy_index=rank, stage=rank, replica=0, num_stages=2,
                      num_replicas=1, hosted=("policy",))
    objective = GRPOObjective(cfg.grpo, cfg.sampling.max_tokens)
    trainer = PolicyTrainer(cfg, roles, model_dir, torch.device("cpu"), False, objective=objective, batch_size=ROWS)
    # Learning rate 0: every update sees the same weights, so the cuts can be compared.
    trainer.engine.lr_scheduler.base_lrs = [0.0] * len(trainer.optimizer.param_groups)
    for group in trainer.optimizer.param_groups:
        group["lr"] = 0.0
    # The gradients the optimizer steps with (ZeRO-1's flat fp32 partitions, after the reductions).
    captured = {}
    optimizer_step = trainer.optimizer.step

    def capture_grads_then_step(*args, **kwargs):
        params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
        captured.update({f"flat{i}": p.grad.detach().clone() for i, p in enumerate(params) if p.grad is not None})
        return optimizer_step(*args, **kwargs)

    trainer.optimizer.step = capture_grads_then_step
    batch = _batch()
    out = {}
    for aggregation in AGGREGATIONS:
        cfg.grpo.aggregation = aggregation
        for name, tokens in CUTS:
            cfg.optim.micro_batch_tokens = tokens
            plan = trainer.micro_batch_rows(batch)
            metrics = trainer.update(batch)
            out[aggregation, name] = {"grads": dict(captured), "metrics": metrics,
                                      "gas": trainer.engine.gradient_accumulation_steps(),
                                      "plan": [rows.tolist() for rows in plan]}
    results[rank] = out


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    from tiny_models import tiny_model_dir

    model_dir = tiny_model_dir(tmp_path_factory.mktemp("mb") / "llama", num_layers=2)
    with mp.Manager() as m:
        results = m.dict()
        mp.start_processes(_pipeline_worker, args=(free_port(), model_dir, results), nprocs=2,
                           start_method="spawn", join=True)
        return dict(results)


def test_the_cuts_differ_and_deepspeed_runs_as_many_micro_batches(pipeline_runs):
    runs = pipeline_runs[1]
    plans = {name: runs["token", name]["plan"] for name, _ in CUTS}
    assert plans["fixed"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert len({len(p) for p in plans.values()}) == 3  # three different micro-batch counts
    for (_, name), run in runs.items():
        assert run["gas"] == len(run["plan"]) == len(plans[name])
    widths = row_widths(_batch().attention_mask)
    as_tensors = lambda p: [torch.tensor(rows) for rows in p]
    assert padded_tokens(widths, as_tensors(plans["budget_small"])) < padded_tokens(widths, as_tensors(plans["fixed"]))


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_token_budget_micro_batches_give_the_same_loss_and_gradients(pipeline_runs, aggregation):
    last = pipeline_runs[1]
    want = last[aggregation, "fixed"]["metrics"]
    for name, _ in CUTS[1:]:
        got = last[aggregation, name]["metrics"]
        for key in ("loss", "grad_norm", "pg_loss", "rollout_mismatch/kl", "rollout_mismatch/ratio_mean",
                    "rollout_mismatch/ratio_max", "rollout_mismatch/ratio_min"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (name, key)
    assert abs(want["loss"]) > 1e-3 and want["grad_norm"] > 1e-3
    for stage in (0, 1):
        runs = pipeline_runs[stage]
        want_grads = runs[aggregation, "fixed"]["grads"]
        assert want_grads and all(g.abs().sum() > 0 for g in want_grads.values())
        for name, _ in CUTS[1:]:
            got_grads = runs[aggregation, name]["grads"]
            assert got_grads.keys() == want_grads.keys()
            for param, g in got_grads.items():
                torch.testing.assert_close(g, want_grads[param], rtol=1e-5, atol=1e-7, msg=f"{name} {param}")
