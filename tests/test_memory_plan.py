"""The hint that a sleeping engine would fit awake beside the policy (rlft.runtime.memory_plan)."""
import logging

import pytest
import torch

from rlft.config import load_config
from rlft.runtime.context import RankContext
from rlft.runtime.memory_plan import AWAKE_MARGIN, awake_spare_gib, note_sleep_mode, shared_gpu_plan, sleep_mode_hint

GIB = 2**30


def plan_for(total_gib: float, share: float = 0.3) -> dict[str, float]:
    cfg = load_config(None, ["sampling.backend=vllm", f"sampling.vllm.gpu_memory_utilization={share}",
                             "optim.divergence_factor=0"])
    return shared_gpu_plan(cfg, total_bytes=int(total_gib * GIB), params=1_543_714_304, policy_dtype=torch.bfloat16,
                           reference_here=False)


def test_awake_fit_counts_the_engine_headroom_and_a_margin_on_the_train_peak():
    # A 1.5B model at W-big on an H200: the train phase peaked at 46.5 GiB allocated.
    h200 = plan_for(140)
    assert h200["engine"] == pytest.approx(42.0) and h200["headroom"] == pytest.approx(7.0)
    assert AWAKE_MARGIN == 0.25
    assert awake_spare_gib(h200, 46.5) == pytest.approx(140 - 42 - 7 - 46.5 * 1.25)  # 32.875
    hint = sleep_mode_hint(h200, 46.5, wake_s=0.077, sleep_setting="sampling.vllm.sleep_mode")
    assert hint.startswith("sleep mode: the engine's wake took 0.08 s of this step's sync. The train phase peaked "
                           "at 46.5 GiB; with the engine kept awake (42.0 GiB) and headroom (7.0 GiB) this 140 GiB "
                           "GPU would keep 32.9 GiB spare beyond 25% more than that peak")
    assert "sampling.vllm.sleep_mode=false" in hint
    # The same run on an 80 GiB GPU: 80 - 24 - 4 - 58.1 < 0, so no hint.
    small = plan_for(80)
    assert awake_spare_gib(small, 46.5) == pytest.approx(80 - 24 - 4 - 58.125)
    assert sleep_mode_hint(small, 46.5, wake_s=0.1, sleep_setting="x") is None
    # Exactly at the edge: nothing spare is not enough.
    edge = (140 - 42 - 7) / 1.25
    assert sleep_mode_hint(h200, edge, wake_s=0.1, sleep_setting="x") is None
    assert sleep_mode_hint(h200, edge - 0.1, wake_s=0.1, sleep_setting="x")


def test_the_hint_is_given_once_after_the_launch_s_second_step_and_only_with_sleep_mode(caplog):
    def ctx_for(sleep_mode: bool) -> RankContext:
        cfg = load_config(None, ["sampling.backend=vllm", f"sampling.vllm.sleep_mode={str(sleep_mode).lower()}"])
        ctx = RankContext(cfg=cfg, roles=None, bridge=None, device=torch.device("cuda"))  # vLLM sleeps on GPUs only
        ctx.gpu_plan, ctx.phase_memory_gb = plan_for(140), {"train": 46.5}
        return ctx

    def hints() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("sleep mode:")]

    caplog.set_level(logging.INFO, logger="rlft")
    metrics = {"time/sync/wake": 0.12}
    ctx = ctx_for(True)
    note_sleep_mode(ctx, step=11, start=10, metrics=metrics)  # the launch's first step (resumed at 10)
    assert hints() == [] and not ctx.sleep_hint_given
    note_sleep_mode(ctx, step=12, start=10, metrics={})  # a step without a sync: nothing to say yet
    assert hints() == []
    note_sleep_mode(ctx, step=13, start=10, metrics=metrics)
    assert len(hints()) == 1 and "wake took 0.12 s" in hints()[0]
    note_sleep_mode(ctx, step=14, start=10, metrics=metrics)
    assert len(hints()) == 1
    # Already awake, or no GPU shared: nothing.
    awake = ctx_for(False)
    note_sleep_mode(awake, step=3, start=0, metrics=metrics)
    apart = ctx_for(True)
    apart.gpu_plan = None
    note_sleep_mode(apart, step=3, start=0, metrics=metrics)
    assert len(hints()) == 1
