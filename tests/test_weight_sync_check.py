"""The sampler's rank checks after every sync that its engine holds the policy's weights."""
import pytest
import torch

from rlft.engines.base import named_weights_checksum
from rlft.runtime.sync import SYNC_TOLERANCE, sync_mismatch


def stage_parts(weights: dict[str, torch.Tensor], stages: int) -> list[dict]:
    """What each policy stage's rank reports: the checksum of its share of the weights."""
    names = sorted(weights)
    parts = []
    for stage in range(stages):
        share = {n: weights[n] for n in names[stage::stages]}
        sums = named_weights_checksum(share.items())
        parts.append({f"sync/policy_sum/stage{stage}": sums["sum"], f"sync/policy_abs_sum/stage{stage}": sums["abs_sum"]})
    return parts


def engine_part(weights: dict[str, torch.Tensor]) -> dict:
    sums = named_weights_checksum(weights.items())
    return {"sync/engine_sum": sums["sum"], "sync/engine_abs_sum": sums["abs_sum"], "reward/mean": 0.5}


@pytest.fixture
def policy():
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.mlp.down_proj.weight": 0.02 * torch.randn(64, 64, generator=g) for i in range(8)}


def test_an_engine_holding_the_policy_passes_whatever_the_stage_split(policy):
    # The engine sums the same weights in another order (reversed names): float64 agrees to ~1e-15.
    reordered = dict(reversed(list(policy.items())))
    for stages in (1, 3):
        assert sync_mismatch(stage_parts(policy, stages) + [engine_part(reordered)]) is None


def test_a_layer_the_update_missed_is_caught(policy):
    # The engine kept layer 5 as it was at the start while the policy's moved on (here: other values).
    g = torch.Generator().manual_seed(1)
    missed = dict(policy)
    missed["model.layers.5.mlp.down_proj.weight"] = 0.02 * torch.randn(64, 64, generator=g)
    problem = sync_mismatch(stage_parts(policy, 2) + [engine_part(missed)])
    assert problem is not None and "does not hold the policy's weights" in problem


def test_the_difference_is_measured_against_the_absolute_sum(policy):
    # Every weight of one layer of eight off by 1e-6 (the same sign): the sum differs by 4096e-6,
    # 7.8e-6 of the absolute sum (524), above the tolerance; a tenth of that (7.8e-7) passes.
    abs_sum = named_weights_checksum(policy.items())["abs_sum"]
    for shift, caught in ((1e-6, True), (1e-7, False)):
        shifted = dict(policy)
        shifted["model.layers.5.mlp.down_proj.weight"] = policy["model.layers.5.mlp.down_proj.weight"] - shift
        problem = sync_mismatch(stage_parts(policy, 2) + [engine_part(shifted)])
        assert (problem is not None) == caught, (shift, problem)
        assert (4096 * shift / abs_sum > SYNC_TOLERANCE) == caught
    assert f"{4096e-6 / abs_sum:.2g}" == "7.8e-06"


def test_nothing_to_compare_is_not_a_mismatch(policy):
    assert sync_mismatch(stage_parts(policy, 2)) is None  # no engine on the sampler's rank
    assert sync_mismatch([engine_part(policy)]) is None  # no policy stage reported
