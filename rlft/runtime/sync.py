"""Fresh policy weights into the engines (the sampler's and the evaluator's), in place."""
from __future__ import annotations

import concurrent.futures
import time

from rlft.engines import backend_record
from rlft.engines.base import named_weights_checksum
from rlft.runtime.context import RankContext
from rlft.config.topology import policy_rank_of

SYNC_TAG = 100  # + stage: one point-to-point stream per pipeline stage
# How far the engine's checksums may stray from the policy's, relative to the policy's absolute sum.
# float64 sums of the same weights in another order agree to ~1e-15 (every run measured so far);
# 16-bit weights, summed in float32 blocks first (`weights_checksum_of`), to well under 1e-9.
# What this catches: weights the update missed or loaded wrongly, another model, garbage; not
# small differences such as one layer one step behind, whose updates of either sign mostly cancel
# in both sums.
SYNC_TOLERANCE = 1e-6


# One thread that sums the engine's weights while the rank sums the policy's (`sync_weights`).
_CHECKSUMS = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlft-engine-checksum")


def _timed_checksum(engine) -> tuple[dict, float]:
    started = time.perf_counter()
    sums = engine.weights_checksum()
    return sums, time.perf_counter() - started


class WeightSyncError(RuntimeError):
    """The sampler's engine does not hold the policy's weights after a sync; the message says by how much."""


def sync_mismatch(parts: list[dict]) -> str | None:
    """Compares what the policy stages sent with what the sampler's engine holds, from every rank's
    `sync_weights` numbers; returns what differs, or None when they agree (or nothing was measured)."""
    merged: dict = {}
    for part in parts:
        merged.update(part)
    policy = {kind: sum(v for k, v in merged.items() if k.startswith(f"sync/policy_{kind}/"))
              for kind in ("sum", "abs_sum")}
    if "sync/engine_sum" not in merged or not any(k.startswith("sync/policy_sum/") for k in merged):
        return None
    engine = {kind: merged[f"sync/engine_{kind}"] for kind in ("sum", "abs_sum")}
    scale = max(abs(policy["abs_sum"]), 1.0)
    worst = max(abs(engine[kind] - policy[kind]) for kind in engine) / scale
    if worst <= SYNC_TOLERANCE:
        return None
    return (f"after the weight sync the sampler's engine does not hold the policy's weights: sum "
            f"{engine['sum']:.10g} against the policy's {policy['sum']:.10g}, absolute sum {engine['abs_sum']:.10g} "
            f"against {policy['abs_sum']:.10g} (difference {worst:.2g} of the absolute sum, allowed "
            f"{SYNC_TOLERANCE:g}); its samples would come from another policy, so the run stops here (the "
            f"checkpoints saved so far hold the trained weights)")


def _stream_stages(ctx: RankContext, targets: list[int], engines: list, complete: bool) -> None:
    """Every stage's tensors (replica 0) into the engines of the `targets` ranks: loaded in place where
    the stage and the engine share a rank, sent over the bridge otherwise (`complete`: every weight,
    not only LoRA's adapted ones)."""
    t, roles, bridge = ctx.cfg.topology, ctx.roles, ctx.bridge
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


def sync_weights(ctx: RankContext) -> dict:
    """Stream every stage's tensors (replica 0) to the ranks whose engines need them.

    Returns checksums that prove the copy: each stage reports the sum and absolute sum of its
    weights, the sampler's rank what its engine now holds.  The sampler's rank compares the totals
    and raises `WeightSyncError` when they differ (`sync_mismatch`); the other ranks then stop as
    for any failed rank.
    """
    t, roles, bridge = ctx.cfg.topology, ctx.roles, ctx.bridge
    targets = [t.sampler_rank]
    if t.evaluator_rank != t.sampler_rank:
        targets.append(t.evaluator_rank)
    engines = ctx.engines()
    # With LoRA only the adapted weights travel (merged): the engines keep the base model's others,
    # unless the engine's record says it may drop them (a sleeping vLLM engine, level 2); the
    # checksums below still cover every weight.
    complete = backend_record(ctx.cfg).sync_complete(ctx.cfg, ctx.device.type)
    clock = time.perf_counter()
    for e in engines:
        e.wake()
    woken = time.perf_counter()
    _stream_stages(ctx, targets, engines, complete)
    loaded = time.perf_counter()
    out: dict = {}
    engine_check = None
    if roles.sampler and engines:  # the sampler's engine (in SFT the evaluator's, on the same rank)
        # Summed in a thread of its own (a vLLM engine in its worker process) while this rank sums
        # its share of the policy, when it holds one.
        engine_check = _CHECKSUMS.submit(_timed_checksum, engines[0])
    if roles.policy and roles.replica == 0:
        started = time.perf_counter()
        sums = named_weights_checksum(ctx.policy.export_state().items())
        out.update({f"sync/policy_sum/stage{roles.stage}": sums["sum"],
                    f"sync/policy_abs_sum/stage{roles.stage}": sums["abs_sum"],
                    # the stage's own sum (seconds), against the engine's: which side the checksums wait on
                    f"time/sync/checksum_policy/stage{roles.stage}": time.perf_counter() - started})
    if engine_check is not None:
        sums, engine_seconds = engine_check.result()
        done = time.perf_counter()
        out.update({"sync/engine_sum": sums["sum"], "sync/engine_abs_sum": sums["abs_sum"],
                    # where the sampler's rank spent the sync (seconds): waking its engines, taking the
                    # weights in (and waiting for them), checksumming; and two parts of these: the
                    # engines' processing after the last bucket, and the engine's own checksum
                    "time/sync/wake": woken - clock, "time/sync/load": loaded - woken,
                    "time/sync/checksum": done - loaded, "time/sync/checksum_engine": engine_seconds})
        finish = [f for e in engines if (f := getattr(e, "last_sync_finish_seconds", None)) is not None]
        if finish:
            out["time/sync/load_finish"] = sum(finish)
    parts = bridge.gather_objects(out, dst=t.sampler_rank)
    if parts is not None and (problem := sync_mismatch(parts)):
        raise WeightSyncError(problem)
    return out
