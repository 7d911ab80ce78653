"""Fresh policy weights into the engines (the sampler's and the evaluator's), in place; with
`model.lora.sync: adapter`, the policy's LoRA adapters, which the engines load as their adapter."""
from __future__ import annotations

import concurrent.futures
import time

import torch

from rlft.engines import backend_record
from rlft.engines.base import adapter_weights_checksum, named_weights_checksum
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


def _timed_checksum(engine, adapters: bool) -> tuple[dict, float]:
    started = time.perf_counter()
    sums = engine.adapter_checksum() if adapters else engine.weights_checksum()
    return sums, time.perf_counter() - started


class WeightSyncError(RuntimeError):
    """The sampler's engine does not hold the policy's weights after a sync; the message says by how much."""


def sync_mismatch(parts: list[dict], *, adapters: bool = False) -> str | None:
    """Compares what the policy stages sent with what the sampler's engine holds, from every rank's
    `sync_weights` numbers; returns what differs, or None when they agree (or nothing was measured).
    `adapters`: the numbers are the LoRA adapters' (`model.lora.sync: adapter`), not the weights'."""
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
    what = "LoRA adapter" if adapters else "weights"
    return (f"after the weight sync the sampler's engine does not hold the policy's {what}: sum "
            f"{engine['sum']:.10g} against the policy's {policy['sum']:.10g}, absolute sum {engine['abs_sum']:.10g} "
            f"against {policy['abs_sum']:.10g} (difference {worst:.2g} of the absolute sum, allowed "
            f"{SYNC_TOLERANCE:g}); its samples would come from another policy, so the run stops here (the "
            f"checkpoints saved so far hold the trained weights)")


def _stream_stages(ctx: RankContext, targets: list[int], engines: list, complete: bool, adapters: bool) -> None:
    """Every stage's tensors (replica 0) into the engines of the `targets` ranks: loaded in place where
    the stage and the engine share a rank, sent over the bridge otherwise (`complete`: every weight,
    not only LoRA's adapted ones).  `adapters` (`model.lora.sync: adapter`): the stages' LoRA adapters
    instead, which each target's engines load once all the stages' parts have come."""
    t, roles, bridge = ctx.cfg.topology, ctx.roles, ctx.bridge
    if adapters and (unable := [type(e).__name__ for e in engines if not e.takes_adapters]):
        raise RuntimeError(f"model.lora.sync adapter: this rank's {', '.join(unable)} was built without LoRA adapters")

    def state() -> dict:
        return ctx.policy.adapter_state() if adapters else ctx.policy.sync_state(complete=complete)

    def load(named: list) -> None:
        for e in engines:
            (e.update_adapter if adapters else e.update_weights)(named)

    for target in targets:
        for stage in range(t.pipeline_stages):
            src = policy_rank_of(t, replica=0, stage=stage)
            if roles.rank == src and roles.rank == target:
                load(list(state().items()))
            elif roles.rank == src:
                bridge.send_named_tensors(state().items(), dst=target, tag=SYNC_TAG + stage)
            elif roles.rank == target:
                load(list(bridge.recv_named_tensors(src, tag=SYNC_TAG + stage, device=ctx.device)))
        if adapters and roles.rank == target:
            for e in engines:
                e.finish_adapter_update()


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
    # checksums below still cover every weight.  With model.lora.sync adapter only the adapters
    # travel, and the checksums cover them (the base weights never change in the engines).
    complete = backend_record(ctx.cfg).sync_complete(ctx.cfg, ctx.device.type)
    adapters = ctx.cfg.model.lora.sends_adapters
    clock = time.perf_counter()
    for e in engines:
        e.wake()
    woken = time.perf_counter()
    _stream_stages(ctx, targets, engines, complete, adapters)
    loaded = time.perf_counter()
    out: dict = {}
    engine_check = None
    if roles.sampler and engines:  # the sampler's engine (in SFT the evaluator's, on the same rank)
        # Summed in a thread of its own (a vLLM engine in its worker process) while this rank sums
        # its share of the policy, when it holds one.
        engine_check = _CHECKSUMS.submit(_timed_checksum, engines[0], adapters)
    if roles.policy and roles.replica == 0:
        out.update(_policy_checksum(ctx, adapters))
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
    if parts is not None and (problem := sync_mismatch(parts, adapters=adapters)):
        raise WeightSyncError(problem)
    return out


def _policy_checksum(ctx: RankContext, adapters: bool) -> dict:
    """This stage's sums of what it sent: its weights (merged with LoRA), or its LoRA adapters as the
    engine holds them (`adapter_weights_checksum`: B scaled by alpha / rank, in the engines' dtype)."""
    started, stage, lora = time.perf_counter(), ctx.roles.stage, ctx.cfg.model.lora
    if adapters:
        sums = adapter_weights_checksum(ctx.policy.adapter_state().items(), scaling=lora.alpha / lora.rank,
                                        dtype=getattr(torch, ctx.dtype))
    else:
        sums = named_weights_checksum(ctx.policy.export_state().items())
    return {f"sync/policy_sum/stage{stage}": sums["sum"], f"sync/policy_abs_sum/stage{stage}": sums["abs_sum"],
            # the stage's own sum (seconds), against the engine's: which side the checksums wait on
            f"time/sync/checksum_policy/stage{stage}": time.perf_counter() - started}
