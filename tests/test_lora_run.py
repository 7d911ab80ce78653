"""A LoRA policy end to end on CPU: `launch/train.sh` -> the deepspeed launcher -> 2 ranks on gloo.

Layout: ranks 0-1 a 2-stage policy pipeline with LoRA adapters; rank 1 also hosts the sampler, the
evaluator and the reference, which is the policy's own pipeline with its adapters off. One run of 4
steps straight, and one of 2 steps resumed to 4: the resumed run must repeat the straight one.
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch

from test_train_integration import launch, read_steps

TWO_RANKS = ("topology.policy_ranks=[0,1]", "topology.pipeline_stages=2", "topology.sampler_rank=1",
             "topology.reference_rank=1", "topology.evaluator_rank=1")
LORA = ("model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=16",
        "model.lora.target_modules=[q_proj,v_proj,down_proj]")
TARGETS = ("q_proj", "v_proj", "down_proj")
# Numbers that depend on the machine's speed, not on what was computed.
TIMING = ("time", "throughput/", "memory/")  # "time": the wall clock; "time/...": phases


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    from conftest import taught_sums

    root = tmp_path_factory.mktemp("lora_grpo")
    model, data = taught_sums(root, teach_steps=100, test_size=4)
    common = (f"model.path={model}", f"data.source={data}", "sampling.repetition_penalty=1.0",
              "data.prompt_template=r1_short", "optim.lr=1e-2", "schedule.evaluate_freq=0",
              "grpo.mismatch_metrics_every=1", *TWO_RANKS, *LORA)
    straight, resumed = root / "straight", root / "resumed"
    runs = {}
    for name, out, steps in (("straight", straight, 4), ("first", resumed, 2), ("second", resumed, 4)):
        t0 = time.time()
        res = launch(*common, f"output.dir={out}", f"schedule.steps={steps}")
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
        print(f"\nCPU wall time, {name} launch: {time.time() - t0:.1f} s")
        runs[name] = res
    return {"model": Path(model), "data": data, "straight": straight, "resumed": resumed, "runs": runs}


def without_timing(step: dict) -> dict:
    return {k: v for k, v in step.items() if not k.startswith(TIMING) and k not in ("eval/seconds", "eval/examples_per_s")}


def without_eval(step: dict) -> dict:
    return {k: v for k, v in without_timing(step).items() if not k.startswith("eval/")}


def test_resumed_run_repeats_the_straight_one(lora_runs):
    straight, resumed = read_steps(lora_runs["straight"]), read_steps(lora_runs["resumed"])
    assert [s["step"] for s in resumed] == [1, 2, 3, 4]
    assert "resuming from" in lora_runs["runs"]["second"].stderr
    # Every number equal; the 2-step launch evaluated after its last step (step 2), the straight one not.
    assert [without_timing(s) for s in resumed[2:]] == [without_timing(s) for s in straight[2:]]
    assert [without_eval(s) for s in resumed[:2]] == [without_eval(s) for s in straight[:2]]
    assert resumed[-1]["eval/accuracy"] == straight[-1]["eval/accuracy"]
    assert any(s["grad_norm"] > 1e-3 for s in straight)  # the adapters did learn something
    for name in ("model.safetensors.index.json",):
        assert (lora_runs["straight"] / "model" / name).is_file()
    a = adapter_weights(lora_runs["straight"])
    b = adapter_weights(lora_runs["resumed"])
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


def adapter_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "model" / "adapter" / "adapter_model.safetensors"))


def test_only_the_adapted_weights_moved(lora_runs):
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(lora_runs["straight"] / "model").state_dict()
    start = AutoModelForCausalLM.from_pretrained(lora_runs["model"]).state_dict()
    moved = {n for n, p in trained.items() if not torch.equal(p, start[n])}
    adapted = {n for n in start if n.endswith(".weight") and n.split(".")[-2] in TARGETS}
    assert moved and moved <= adapted
    assert len(moved) > len(adapted) // 2  # most adapted matrices moved (some may see no gradient)
    # DeepSpeed's files hold the adapters only: no base weight, and optimizer state for adapters only.
    ckpt = lora_runs["straight"] / "checkpoints" / "step_000004" / "deepspeed"
    layer_files = sorted(ckpt.glob("layer_*-model_states.pt"))
    assert layer_files
    saved = {k for f in layer_files for k in torch.load(f, weights_only=False)}
    assert saved and all(".lora_" in k for k in saved), sorted(saved)[:5]
    n_adapter = sum(v.numel() for v in adapter_weights(lora_runs["straight"]).values())
    optim = [torch.load(f, weights_only=False) for f in ckpt.glob("*optim_states.pt")]
    state_numel = 0
    for o in optim:
        opt = o["optimizer_state_dict"]
        inner = opt.get("base_optimizer_state", opt).get("state", {})
        state_numel += sum(s["exp_avg"].numel() for s in (inner.values() if isinstance(inner, dict) else inner))
    assert state_numel == n_adapter


def test_merged_export_is_base_plus_adapter(lora_runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from test_pipeline import hf_logprobs, padded_batch, scored

    out = lora_runs["straight"] / "model"
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    base = AutoModelForCausalLM.from_pretrained(lora_runs["model"])
    with_adapter = PeftModel.from_pretrained(copy.deepcopy(base), out / "adapter").eval()
    batch = padded_batch(0, rows=3, T=12, left=(2, 0, 0), vocab=400)
    with torch.no_grad():
        a, _ = hf_logprobs(merged, batch)
        b, _ = hf_logprobs(with_adapter, batch)
        c, _ = hf_logprobs(base.eval(), batch)
    valid = scored(batch)
    assert (a - b)[valid].abs().max() <= 1e-5
    assert (a - c)[valid].abs().max() > 1e-4  # the adapters changed the policy
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16 and sorted(config["target_modules"]) == sorted(TARGETS)


def test_reference_is_the_base_model_and_sync_is_checked(lora_runs):
    steps = read_steps(lora_runs["straight"])
    # Step 1: adapters start at B = 0, so the policy is the base model and KL to it is 0; once the
    # adapters moved, the reference (the same pipeline, adapters off) differs from the policy.
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-7)
    moved = [cur["kl"] for prev, cur in zip(steps, steps[1:]) if prev["grad_norm"] > 1e-3]
    assert moved and all(kl > 1e-6 for kl in moved)
    for s in steps:  # the sampler holds the trainer's merged policy after every sync
        assert s["sync/engine_sum"] == pytest.approx(s["sync/policy_sum"], rel=1e-9, abs=1e-9)
        assert s["sync/engine_abs_sum"] == pytest.approx(s["sync/policy_abs_sum"], rel=1e-9)
        assert abs(s["rollout_mismatch/kl"]) < 1e-6  # and samples with it (logged every step here)


def test_weights_only_resume_takes_the_base_model_and_the_adapters(lora_runs, tmp_path):
    import shutil

    # The 2-stage run's last checkpoint, resumed by one process holding a 1-stage policy.
    out = tmp_path / "out"
    shutil.copytree(lora_runs["straight"] / "checkpoints" / "step_000004", out / "checkpoints" / "step_000004")
    model, data = lora_runs["model"], lora_runs["data"]
    res = launch(f"model.path={model}", f"data.source={data}", "sampling.repetition_penalty=1.0",
                 "data.prompt_template=r1_short", "optim.lr=1e-2", "schedule.evaluate_freq=0", *LORA,
                 "topology.policy_ranks=[0]", "topology.pipeline_stages=1", "topology.sampler_rank=0",
                 "topology.reference_rank=0", "topology.evaluator_rank=0", f"output.dir={out}",
                 "schedule.steps=5", "output.resume_weights_only=true")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "resuming the weights only" in res.stderr
    step = read_steps(out)[-1]
    assert step["step"] == 5
    # The policy is the base model plus the checkpoint's adapters, the reference the base model: they
    # differ. (Fresh adapters on the merged export would make both the merged model: KL 0.)
    assert step["kl"] > 1e-6
    assert step["sync/engine_sum"] == pytest.approx(step["sync/policy_sum"], rel=1e-9, abs=1e-9)
