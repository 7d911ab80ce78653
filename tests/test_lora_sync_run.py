"""`model.lora.sync: adapter` end to end on CPU: `launch/train.sh` -> the deepspeed launcher -> 2 ranks on
gloo, the sampler on vLLM (its CPU build), against the same run with merged syncs.

Layout (as tests/test_lora_run.py): ranks 0-1 a 2-stage policy pipeline with LoRA adapters; rank 1 also
hosts the sampler, the evaluator and the reference (the policy's own pipeline, adapters off).  So each
adapter sync takes stage 1's part in place and stage 0's over the bridge, and loads them once.
"""
from __future__ import annotations

import importlib.util
import time

import pytest

from test_lora_run import LORA, TIMING, TWO_RANKS
from test_train_integration import launch, read_steps

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory, taught_sums_dirs):
    model, data = taught_sums_dirs
    root = tmp_path_factory.mktemp("lora_sync")
    common = (f"model.path={model}", f"data.source={data}", "sampling.repetition_penalty=1.0",
              "data.prompt_template=r1_short", "optim.lr=1e-2", "schedule.evaluate_freq=0", "schedule.save_every=0",
              "grpo.mismatch_metrics_every=1", "grpo.group_size=4", "optim.rollout_batch_size=8", "sampling.backend=vllm", f"schedule.steps={STEPS}", *TWO_RANKS, *LORA)
    out = {}
    for mode in ("merged", "adapter"):
        t0 = time.time()
        res = launch(*common, f"model.lora.sync={mode}", f"output.dir={root / mode}", timeout=900)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
        print(f"\nCPU wall time, {mode} syncs: {time.time() - t0:.1f} s")
        out[mode] = {"steps": read_steps(root / mode), "stderr": res.stderr}
    return out


def comparable(step: dict) -> dict:
    """A step's numbers but the clocks and the sync's checksums (of merged weights in one run, of the
    adapters in the other)."""
    return {k: v for k, v in step.items() if not k.startswith((*TIMING, "sync/", "eval/seconds", "eval/examples_per_s"))}


def test_adapter_syncs_train_as_merged_syncs(runs):
    merged, adapter = runs["merged"]["steps"], runs["adapter"]["steps"]
    assert [s["step"] for s in adapter] == [s["step"] for s in merged] == list(range(1, STEPS + 1))
    # the adapters moved before steps 2 and 3 sampled
    assert any(s["grad_norm"] > 1e-3 for s in adapter[:-1]), [(s["reward/mean"], s["grad_norm"]) for s in adapter]
    # Step 1 samples from the start: the base model in the merged run, the base model and an adapter of
    # B = 0 (peft's start, loaded by the sync at start) in the other, whose LoRA term adds exact zeros.
    # Every number of the step is the same, the sampler's log-probs too.
    assert comparable(adapter[0]) == comparable(merged[0])
    # Later steps sample with trained adapters: vLLM computes x W^T + s (x A^T) B^T against the merged
    # run's x (W + s B A)^T, equal up to float32 rounding (~1e-7 in the log-probs).  The seeded samples,
    # and so the rewards, the batch, the loss and the update, are the same; the sampler's log-probs (only
    # read by the mismatch metrics here) agree to that rounding.
    for a, m in zip(adapter[1:], merged[1:]):
        for key in ("reward/mean", "reward/format", "response_length/mean", "tokens/response", "kl", "loss",
                    "grad_norm"):
            assert a[key] == m[key], key
        assert abs(a["rollout_mismatch/kl"] - m["rollout_mismatch/kl"]) < 1e-6
        # The policy sampled from is far from the base model (the trained adapters are in the sampler).
        assert a["kl"] > 1e-4 and abs(a["rollout_mismatch/kl"]) < 1e-6
    assert adapter[-1]["eval/accuracy"] == merged[-1]["eval/accuracy"]  # the final evaluation's engine too


def test_every_adapter_sync_is_checked_and_named_at_start(runs):
    for s in runs["adapter"]["steps"]:
        # The engine's sums of the adapter vLLM holds equal the stages' sums of what they sent (2 stages).
        assert s["sync/engine_sum"] == pytest.approx(s["sync/policy_sum"], rel=1e-9, abs=1e-9)
        assert s["sync/engine_abs_sum"] == pytest.approx(s["sync/policy_abs_sum"], rel=1e-9)
        assert 0 < s["time/sync/load_finish"] < s["time/sync/load"]
        assert abs(s["rollout_mismatch/kl"]) < 1e-6  # and samples with it
    # The adapters are a small part of the model: their sums are far below the merged weights'.
    assert runs["adapter"]["steps"][0]["sync/policy_abs_sum"] < runs["merged"]["steps"][0]["sync/policy_abs_sum"] / 10
    assert "model.lora.sync: adapter: each weight sync sends the LoRA adapters alone (" in runs["adapter"]["stderr"]
    assert "model.lora.sync: merged: each weight sync sends the adapted projections" in runs["merged"]["stderr"]
