"""Fresh policy weights into the engines (the sampler's and the evaluator's), in place."""
from __future__ import annotations

from rlft.engines.base import named_weights_checksum
from rlft.runtime.context import RankContext
from rlft.topology import policy_rank_of

SYNC_TAG = 100  # + stage: one point-to-point stream per pipeline stage


def sync_weights(ctx: RankContext) -> dict:
    """Stream every stage's tensors (replica 0) to the ranks whose engines need them.

    Returns checksums that prove the copy: each stage reports the sum and absolute sum of what it
    sent, the sampler's rank what its engine now holds; the coordinator compares the totals.
    """
    t, roles, bridge = ctx.cfg.topology, ctx.roles, ctx.bridge
    targets = [t.sampler_rank]
    if t.evaluator_rank != t.sampler_rank:
        targets.append(t.evaluator_rank)
    engines = ctx.engines()
    # With LoRA only the adapted weights travel (merged): the engines keep the base model's others,
    # unless a sleeping vLLM engine drops its weights (sleep mode, level 2); the checksums below
    # still cover every weight.
    complete = ctx.cfg.sampling.vllm.sleep_mode
    for e in engines:
        e.wake()
    out: dict = {}
    for target in targets:
        for stage in range(t.pipeline_stages):
            src = policy_rank_of(t, replica=0, stage=stage)
            if roles.rank == src and roles.rank == target:
                state = list(ctx.policy.sync_state(complete=complete).items())
                for e in engines:
                    e.update_weights(state)
            elif roles.rank == src:
                bridge.send_named_tensors(ctx.policy.sync_state(complete=complete).items(), dst=target,
                                          tag=SYNC_TAG + stage)
            elif roles.rank == target:
                received = list(bridge.recv_named_tensors(src, tag=SYNC_TAG + stage, device=ctx.device))
                for e in engines:
                    e.update_weights(received)
    if roles.policy and roles.replica == 0:
        sums = named_weights_checksum(ctx.policy.export_state().items())
        out.update({f"sync/policy_sum/stage{roles.stage}": sums["sum"],
                    f"sync/policy_abs_sum/stage{roles.stage}": sums["abs_sum"]})
    if roles.sampler and engines:  # the sampler's engine (in SFT the evaluator's, on the same rank)
        sums = engines[0].weights_checksum()
        out.update({"sync/engine_sum": sums["sum"], "sync/engine_abs_sum": sums["abs_sum"]})
    return out
