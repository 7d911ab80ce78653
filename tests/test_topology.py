"""Roles -> ranks for the shipped layouts, DeepSpeed's pipe-major grid, and impossible topologies refused."""

from pathlib import Path

import pytest

from rlft.config import ConfigError, TopologyConfig, check_topology, load_config
from rlft.config.topology import check_stages_vs_layers, policy_rank_of, roles_for_rank

CONFIGS = Path(__file__).resolve().parents[1] / "launch" / "configs"


def topology_of(name: str) -> TopologyConfig:
    return load_config(CONFIGS / name).topology


def summary(t: TopologyConfig, rank: int) -> tuple:
    """(policy_index, stage, replica, first_stage, last_stage, sampler, reference, evaluator) of one rank."""
    r = roles_for_rank(t, rank)
    return (r.policy_index, r.stage, r.replica, r.first_stage, r.last_stage, r.sampler, r.reference, r.evaluator)


# ---------------------------------------------------------------- the shipped layouts

#                 index stage rep  first  last   sampler reference evaluator
P0_OF_5 = (0, 0, 0, True, False, False, False, False)
ONLY_SAMPLER = (None, None, None, False, False, True, False, False)
ONLY_REFERENCE = (None, None, None, False, False, False, True, False)
ONLY_EVALUATOR = (None, None, None, False, False, False, False, True)


def test_eight_ranks_default_layout():
    t = topology_of("grpo_8gpu.yaml")
    assert t == TopologyConfig()  # the 8-GPU file spells out the defaults
    assert t.world_size() == 8
    assert [summary(t, r) for r in range(8)] == [
        P0_OF_5,
        (1, 1, 0, False, False, False, False, False),
        (2, 2, 0, False, False, False, False, False),
        (3, 3, 0, False, False, False, False, False),
        (4, 4, 0, False, True, False, False, False),
        ONLY_EVALUATOR, ONLY_REFERENCE, ONLY_SAMPLER,
    ]
    roles = [roles_for_rank(t, r) for r in range(8)]
    assert all(r.num_stages == 5 and r.num_replicas == 1 and r.world_size == 8 for r in roles)
    assert [r.policy for r in roles] == [True] * 5 + [False] * 3
    assert roles[0].names() == ["policy[stage 0/5, replica 0]"]
    assert roles[4].describe() == "rank 4 (policy[stage 4/5, replica 0])"
    assert [r.describe() for r in roles[5:]] == ["rank 5 (evaluator)", "rank 6 (reference)", "rank 7 (sampler)"]


def test_four_ranks():
    t = topology_of("grpo_4gpu.yaml")
    assert t.world_size() == 4
    assert [summary(t, r) for r in range(4)] == [
        (0, 0, 0, True, False, False, False, False),
        (1, 1, 0, False, True, False, False, False),
        (None, None, None, False, False, False, True, True),
        ONLY_SAMPLER,
    ]
    assert roles_for_rank(t, 1).names() == ["policy[stage 1/2, replica 0]"]
    assert roles_for_rank(t, 2).names() == ["reference", "evaluator"]
    assert roles_for_rank(t, 2).describe() == "rank 2 (reference + evaluator)"


def test_two_ranks():
    t = topology_of("grpo_2gpu.yaml")
    assert t.world_size() == 2
    # One stage is both the first and the last.
    assert summary(t, 0) == (0, 0, 0, True, True, False, False, False)
    assert summary(t, 1) == (None, None, None, False, False, True, True, True)
    assert roles_for_rank(t, 1).describe() == "rank 1 (sampler + reference + evaluator)"


def test_one_rank_hosts_everything():
    t = topology_of("grpo_1gpu.yaml")
    assert t.world_size() == 1
    assert summary(t, 0) == (0, 0, 0, True, True, True, True, True)
    assert roles_for_rank(t, 0).describe() == (
        "rank 0 (policy[stage 0/1, replica 0] + sampler + reference + evaluator)")


@pytest.mark.parametrize("rank", [-1, 4, 8])
def test_rank_outside_the_topology(rank):
    t = topology_of("grpo_4gpu.yaml")
    with pytest.raises(ConfigError) as info:
        roles_for_rank(t, rank)
    assert str(info.value) == f"rank {rank} is outside the topology's 4 ranks"


# ---------------------------------------------------------------- data parallel: DeepSpeed's grid


def test_two_replicas_of_two_stages_are_pipe_major():
    t = TopologyConfig(policy_ranks=[0, 1, 2, 3], pipeline_stages=2, sampler_rank=5, reference_rank=4,
                       evaluator_rank=4)
    check_topology(t)
    # policy_ranks[stage * replicas + replica]: stage 0 = ranks 0, 1; stage 1 = ranks 2, 3.
    assert [(r.stage, r.replica) for r in (roles_for_rank(t, k) for k in range(4))] == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    assert [policy_rank_of(t, replica=d, stage=s) for s in range(2) for d in range(2)] == [0, 1, 2, 3]
    assert roles_for_rank(t, 1).names() == ["policy[stage 0/2, replica 1]"]
    assert roles_for_rank(t, 3).last_stage and not roles_for_rank(t, 1).last_stage
    assert all(roles_for_rank(t, k).num_replicas == 2 for k in range(4))


def test_policy_ranks_need_not_start_at_zero():
    # The policy index (its rank in the pipeline's own world) differs from the launch rank.
    t = TopologyConfig(policy_ranks=[2, 3, 4, 5], pipeline_stages=2, sampler_rank=0, reference_rank=1,
                       evaluator_rank=1)
    check_topology(t)
    assert [summary(t, r)[:3] for r in range(2, 6)] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert policy_rank_of(t, replica=1, stage=1) == 5
    assert summary(t, 0) == ONLY_SAMPLER


@pytest.mark.parametrize("stages, replicas", [(2, 2), (3, 2), (2, 3), (1, 4), (4, 1)])
def test_grid_matches_deepspeed_topology(stages, replicas):
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    n = stages * replicas
    # Policy ranks listed out of order, so an index/rank mix-up cannot pass.
    policy = [n - 1 - i for i in range(n)]
    t = TopologyConfig(policy_ranks=policy, pipeline_stages=stages, sampler_rank=n, reference_rank=n,
                       evaluator_rank=n)
    check_topology(t)
    ds = PipeDataParallelTopology(num_pp=stages, num_dp=replicas)
    for s in range(stages):
        for d in range(replicas):
            pipe_world_rank = ds.get_rank(pipe=s, data=d)
            launch_rank = policy_rank_of(t, replica=d, stage=s)
            assert launch_rank == policy[pipe_world_rank]
            roles = roles_for_rank(t, launch_rank)
            assert (roles.policy_index, roles.stage, roles.replica) == (pipe_world_rank, s, d)
            assert ds.get_coord(roles.policy_index) == ds.ProcessCoord(pipe=s, data=d)


# ---------------------------------------------------------------- impossible topologies


@pytest.mark.parametrize("topology, message", [
    (dict(policy_ranks=[0, 1, 1, 2], pipeline_stages=2, sampler_rank=3, reference_rank=3, evaluator_rank=3),
     "topology.policy_ranks: rank(s) [1] listed more than once"),
    (dict(policy_ranks=[2, 0, 2, 0], pipeline_stages=2, sampler_rank=1, reference_rank=1, evaluator_rank=1),
     "topology.policy_ranks: rank(s) [0, 2] listed more than once"),
    (dict(policy_ranks=[0, 1, 2], pipeline_stages=2, sampler_rank=3, reference_rank=3, evaluator_rank=3),
     "topology.policy_ranks: 3 policy ranks cannot form pipelines of 2 stages (need a multiple of "
     "topology.pipeline_stages)"),
    (dict(policy_ranks=[0, 1, 2, 3], pipeline_stages=8, sampler_rank=4, reference_rank=4, evaluator_rank=4),
     "topology.policy_ranks: 4 policy ranks cannot form pipelines of 8 stages (need a multiple of "
     "topology.pipeline_stages)"),
    # 2-stage policy with the default sampler/reference/evaluator ranks 7/6/5: ranks 2-4 idle.
    (dict(policy_ranks=[0, 1], pipeline_stages=2),
     "topology: rank(s) [2, 3, 4] of the 8 launched would host no role; renumber the roles to use ranks 0..4"),
    (dict(policy_ranks=[1], pipeline_stages=1, sampler_rank=3, reference_rank=3, evaluator_rank=3),
     "topology: rank(s) [0, 2] of the 4 launched would host no role; renumber the roles to use ranks 0..1"),
    (dict(policy_ranks=[], pipeline_stages=1), "topology.policy_ranks: must list at least one rank"),
    (dict(policy_ranks=[0], pipeline_stages=1, sampler_rank=-1, reference_rank=0, evaluator_rank=0),
     "topology: ranks must be >= 0"),
    (dict(policy_ranks=[0], pipeline_stages=0, sampler_rank=0, reference_rank=0, evaluator_rank=0),
     "topology.pipeline_stages: must be >= 1, got 0"),
    (dict(policy_ranks=[0], pipeline_stages=1, sampler_rank=0, reference_rank=0, evaluator_rank=0, nodes=0),
     "topology.nodes: must be >= 1, got 0"),
])
def test_impossible_topologies_are_refused(topology, message):
    with pytest.raises(ConfigError) as info:
        check_topology(TopologyConfig(**topology))
    assert str(info.value) == message


def test_load_config_refuses_an_impossible_topology():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["topology.policy_ranks=[0,1]", "topology.pipeline_stages=2"])
    assert str(info.value) == (
        "topology: rank(s) [2, 3, 4] of the 8 launched would host no role; renumber the roles to use ranks 0..4")


# ---------------------------------------------------------------- stages vs layers


def test_more_stages_than_layers():
    with pytest.raises(ConfigError) as info:
        check_stages_vs_layers(num_layers=2, num_stages=3)
    assert str(info.value) == "topology.pipeline_stages: 3 stages for a model with only 2 transformer layers"


@pytest.mark.parametrize("layers, stages, per, empty, valid", [
    # 4 layers / 3 stages: ceil(4/3) = 2 per stage -> [2, 2, 0].  Valid: 1 -> [4], 2 -> [2, 2], 4 -> [1]*4.
    (4, 3, 2, 1, [1, 2, 4]),
    # 10 layers / 6 stages: 2 per stage -> [2, 2, 2, 2, 2, 0].  3 -> [4, 4, 2], 4 -> [3, 3, 3, 1],
    # 5 -> [2]*5; 6..9 stages all get 2 per stage and run out of layers; 10 -> [1]*10.
    (10, 6, 2, 1, [1, 2, 3, 4, 5, 10]),
    # 10 layers / 7 stages: 2 per stage -> [2, 2, 2, 2, 2, 0, 0]: two empty stages.
    (10, 7, 2, 2, [1, 2, 3, 4, 5, 10]),
])
def test_stage_count_that_leaves_an_empty_stage(layers, stages, per, empty, valid):
    with pytest.raises(ConfigError) as info:
        check_stages_vs_layers(num_layers=layers, num_stages=stages)
    assert str(info.value) == (f"topology.pipeline_stages: {layers} layers split {per} per stage leave "
                               f"{empty} of {stages} stages empty; valid stage counts: {valid}")


@pytest.mark.parametrize("layers, stages", [(4, 1), (4, 2), (4, 4), (24, 5), (28, 5), (30, 4), (1, 1)])
def test_valid_stage_counts_pass(layers, stages):
    check_stages_vs_layers(num_layers=layers, num_stages=stages)


def test_stage_check_agrees_with_splitting_the_layers():
    # Split L layers in order, ceil(L/S) per stage; the check must pass exactly when no stage is empty.
    for layers in range(1, 17):
        for stages in range(1, layers + 1):
            per = -(-layers // stages)
            sizes = [max(0, min(per, layers - i * per)) for i in range(stages)]
            assert sum(sizes) == layers
            if all(sizes):
                check_stages_vs_layers(layers, stages)
            else:
                with pytest.raises(ConfigError):
                    check_stages_vs_layers(layers, stages)


# ---------------------------------------------------------------- several nodes


TWO_BY_EIGHT = CONFIGS / "grpo_2x8gpu.yaml"


@pytest.mark.parametrize("overrides, message", [
    (["topology.launcher=pbs"], "topology.launcher: must be one of pdsh, slurm, openmpi, mpich, impi, mvapich, "
                                "no_ssh, got 'pbs'"),
    (["topology.launcher=no_ssh"], "topology.master_addr: required with topology.launcher=no_ssh (node 0's "
                                   "address, as every node reaches it)"),
    (["topology.node_rank=2"], "topology.node_rank: must be between 0 and topology.nodes - 1 (1), got 2"),
    (["topology.master_port=70000"], "topology.master_port: must be a TCP port (1-65535) or null, got 70000"),
    (["topology.nodes=3"], "topology.nodes: 16 ranks do not split evenly over 3 nodes"),
])
def test_multinode_settings_are_validated(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(TWO_BY_EIGHT, overrides)
    assert str(info.value) == message


def test_two_nodes_of_eight_gpus():
    t = topology_of("grpo_2x8gpu.yaml")
    assert (t.world_size(), t.nodes, t.launcher) == (16, 2, "pdsh")
    roles = [roles_for_rank(t, r) for r in range(16)]
    # Pipe-major order: stage s is ranks 2s and 2s + 1 (its two replicas), so stages 0-3 fill node 0
    # (ranks 0-7) and stages 4-6 the first six GPUs of node 1.
    assert [(r.stage, r.replica) for r in roles[:14]] == [(s, d) for s in range(7) for d in range(2)]
    assert [r.describe() for r in roles[14:]] == ["rank 14 (reference + evaluator)", "rank 15 (sampler)"]
    assert all(r.num_stages == 7 and r.num_replicas == 2 for r in roles)


def test_two_simulated_cpu_nodes():
    t = topology_of("grpo_cpu_2node.yaml")
    assert (t.world_size(), t.nodes, t.launcher, t.master_addr) == (4, 2, "no_ssh", "127.0.0.1")
    assert [summary(t, r) for r in range(4)] == [
        (0, 0, 0, True, False, False, False, False),
        ONLY_REFERENCE,
        (1, 1, 0, False, True, False, False, False),  # global rank 2 is the policy world's rank 1
        (None, None, None, False, False, True, False, True),
    ]


# ---------------------------------------------------------------- every shipped config, every rank


def _policy(stage: int, stages: int, replica: int = 0) -> str:
    return f"policy[stage {stage}/{stages}, replica {replica}]"


# Written out from the roles each rank of the shipped configs hosted before roles became records
# (rlft/config/role_records.py): the same ranks must keep hosting the same roles.
SHIPPED_PLACEMENTS = {
    "grpo_1gpu.yaml": [f"{_policy(0, 1)} + sampler + reference + evaluator"],
    "grpo_instruct_1gpu.yaml": [f"{_policy(0, 1)} + sampler + reference + evaluator"],
    "grpo_tools_1gpu.yaml": [f"{_policy(0, 1)} + sampler + reference + evaluator"],
    "grpo_distill_1gpu.yaml": [f"{_policy(0, 1)} + sampler + reference + teacher + evaluator"],
    "grpo_cpu_demo.yaml": [f"{_policy(0, 1)} + sampler + reference + evaluator"],
    "sft_1gpu.yaml": [f"{_policy(0, 1)} + sampler + reference + evaluator"],
    "sft_tools_coldstart.yaml": [f"{_policy(0, 1)} + sampler + reference + evaluator"],
    "sft_cpu_demo.yaml": [f"{_policy(0, 1)} + sampler + reference + evaluator"],
    "grpo_2gpu.yaml": [_policy(0, 1), "sampler + reference + evaluator"],
    "sft_cpu_tiny.yaml": [_policy(0, 2), f"{_policy(1, 2)} + sampler + reference + evaluator"],
    "grpo_4gpu.yaml": [_policy(0, 2), _policy(1, 2), "reference + evaluator", "sampler"],
    "grpo_cpu_tiny.yaml": [_policy(0, 2), _policy(1, 2), "reference + evaluator", "sampler"],
    "grpo_cpu_2node.yaml": [_policy(0, 2), "reference", _policy(1, 2), "sampler + evaluator"],
    "grpo_8gpu.yaml": [_policy(0, 5), _policy(1, 5), _policy(2, 5), _policy(3, 5), _policy(4, 5),
                       "evaluator", "reference", "sampler"],
    "grpo_2x8gpu.yaml": [_policy(0, 7, 0), _policy(0, 7, 1), _policy(1, 7, 0), _policy(1, 7, 1),
                         _policy(2, 7, 0), _policy(2, 7, 1), _policy(3, 7, 0), _policy(3, 7, 1),
                         _policy(4, 7, 0), _policy(4, 7, 1), _policy(5, 7, 0), _policy(5, 7, 1),
                         _policy(6, 7, 0), _policy(6, 7, 1), "reference + evaluator", "sampler"],
}


def test_every_shipped_config_is_covered():
    assert sorted(SHIPPED_PLACEMENTS) == sorted(p.name for p in CONFIGS.glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(SHIPPED_PLACEMENTS))
def test_each_rank_of_each_shipped_config_hosts_the_roles_it_did(name):
    t = topology_of(name)
    expected = SHIPPED_PLACEMENTS[name]
    assert t.world_size() == len(expected)
    assert [roles_for_rank(t, r).describe() for r in range(t.world_size())] == [
        f"rank {r} ({what})" for r, what in enumerate(expected)]
    policy = [roles_for_rank(t, r) for r in t.policy_ranks]
    assert [r.policy_index for r in policy] == list(range(len(t.policy_ranks)))
