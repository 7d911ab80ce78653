"""A LoRA policy end to end on CPU: `launch/train.sh` -> the deepspeed launcher -> 2 ranks on gloo.

Layout: ranks 0-1 a 2-stage policy pipeline with LoRA adapters; rank 1 also hosts the sampler, the
evaluator and the reference, which is the policy's own pipeline with its adapters off. One run of 4
steps straight (checkpoints at steps 2 and 4), and one resumed from a copy of its step-2 checkpoint:
the resumed run must repeat the straight one. And
SFT with LoRA through `launch/sft.sh` on the same layout and model (2 steps), and resumed from its
step-1 checkpoint.
"""
from __future__ import annotations

import copy
import json
import shutil
import time
from pathlib import Path

import os
import subprocess

import pytest
import torch

from test_train_integration import launch, read_steps

REPO = Path(__file__).resolve().parents[1]
SFT_CONFIG = REPO / "launch" / "configs" / "sft_cpu_tiny.yaml"

TWO_RANKS = ("topology.policy_ranks=[0,1]", "topology.pipeline_stages=2", "topology.sampler_rank=1",
             "topology.reference_rank=1", "topology.evaluator_rank=1")
LORA = ("model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=16",
        "model.lora.target_modules=[q_proj,v_proj,down_proj]")
TARGETS = ("q_proj", "v_proj", "down_proj")
# Numbers that depend on the machine's speed, not on what was computed.
TIMING = ("time", "throughput/", "memory/")  # "time": the wall clock; "time/...": phases


@pytest.fixture(scope="module")
def taught(taught_sums_dirs):
    """(model, data): the tiny model taught the sums and their questions (with `#### N` solutions),
    shared with the other modules that read it."""
    return taught_sums_dirs


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, taught):
    root = tmp_path_factory.mktemp("lora_grpo")
    model, data = taught
    common = (f"model.path={model}", f"data.source={data}", "sampling.repetition_penalty=1.0",
              "data.prompt_template=r1_short", "optim.lr=1e-2", "schedule.evaluate_freq=0",
              "grpo.mismatch_metrics_every=1", *TWO_RANKS, *LORA)
    straight, resumed = root / "straight", root / "resumed"
    runs = {}
    for name, out in (("straight", straight), ("resumed", resumed)):
        if name == "resumed":  # the straight run's step-2 checkpoint and its record of steps 1-4
            shutil.copytree(straight / "checkpoints" / "step_000002", resumed / "checkpoints" / "step_000002")
            shutil.copy(straight / "steps.jsonl", resumed / "steps.jsonl")
        t0 = time.time()
        res = launch(*common, f"output.dir={out}", "schedule.steps=4", "schedule.save_every=2")
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
        print(f"\nCPU wall time, {name} launch: {time.time() - t0:.1f} s")
        runs[name] = res
    return {"model": Path(model), "data": data, "straight": straight, "resumed": resumed, "runs": runs}


def without_timing(step: dict) -> dict:
    return {k: v for k, v in step.items() if not k.startswith(TIMING) and k not in ("eval/seconds", "eval/examples_per_s")}


def test_resumed_run_repeats_the_straight_one(lora_runs):
    straight, resumed = read_steps(lora_runs["straight"]), read_steps(lora_runs["resumed"])
    assert [s["step"] for s in resumed] == [1, 2, 3, 4]
    assert "resuming from" in lora_runs["runs"]["resumed"].stderr and "(step 2)" in lora_runs["runs"]["resumed"].stderr
    # Steps 3-4 run again from the checkpoint: every number equal, the final evaluation's too.
    assert [without_timing(s) for s in resumed[2:]] == [without_timing(s) for s in straight[2:]]
    assert "eval/accuracy" in resumed[-1]
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


# ====================================================================== SFT with LoRA

SFT_LORA = ("sft.train_size=8", "sft.batch_size=2", "sft.max_steps=2", "schedule.evaluate_freq=0",
            "schedule.save_every=1", "optim.lr=1e-2", *LORA)


@pytest.fixture(scope="module")
def sft_lora_run(tmp_path_factory, taught):
    model, data = taught
    out = tmp_path_factory.mktemp("lora_sft") / "run"
    overrides = [f"model.path={model}", f"data.source={data}", f"output.dir={out}", *SFT_LORA]
    env = dict(os.environ, RLFT_PROGRESS="0")
    t0 = time.time()
    res = subprocess.run(["bash", str(REPO / "launch" / "sft.sh"), str(SFT_CONFIG), *overrides],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    print(f"\nCPU wall time, SFT launch: {time.time() - t0:.1f} s")
    return {"model": Path(model), "out": out, "overrides": overrides}


def test_sft_with_lora_starts_from_the_base_model_and_trains_only_adapters(sft_lora_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlft.config import load_config
    from rlft.roles.sft_data import SFTFeeder

    out, model = sft_lora_run["out"], sft_lora_run["model"]
    steps = read_steps(out)
    assert [s["step"] for s in steps] == [1, 2] and all(s["grad_norm"] > 1e-3 for s in steps)
    # Step 1: the adapters start at B = 0, so its loss is the base model's NLL of the first batch's
    # targets, computed here with plain transformers on the batch the run's own feeder draws.
    cfg = load_config(SFT_CONFIG, sft_lora_run["overrides"])
    batch = SFTFeeder(cfg, AutoTokenizer.from_pretrained(model)).next_batch()
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        logits = base(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    nll = float(-(logp * batch.response_mask).sum() / batch.response_mask.sum())
    assert steps[0]["loss"] == pytest.approx(nll, rel=1e-4)
    # The evaluator's engine got the merged policy (the final evaluation's weight sync).
    assert steps[-1]["sync/engine_sum"] == pytest.approx(steps[-1]["sync/policy_sum"], rel=1e-9, abs=1e-9)

    # DeepSpeed's files hold the adapters only; the export differs from the base only in adapted weights.
    ckpt = out / "checkpoints" / "step_000002" / "deepspeed"
    saved = {k for f in ckpt.glob("layer_*-model_states.pt") for k in torch.load(f, weights_only=False)}
    assert saved and all(".lora_" in k for k in saved), sorted(saved)[:5]
    trained = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).state_dict()
    start = base.state_dict()
    assert trained.keys() == start.keys()
    moved = {n for n, p in trained.items() if not torch.equal(p, start[n])}
    adapted = {n for n in start if n.endswith(".weight") and n.split(".")[-2] in TARGETS}
    assert moved and moved <= adapted


def test_sft_with_lora_exports_base_plus_the_merged_delta(sft_lora_run):
    from transformers import AutoModelForCausalLM

    out = sft_lora_run["out"] / "model"
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    base = AutoModelForCausalLM.from_pretrained(sft_lora_run["model"], dtype=torch.float32).state_dict()
    adapter = adapter_weights(sft_lora_run["out"])
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    n_layers = sum(1 for k in base if k.endswith("self_attn.q_proj.weight"))
    # One weight on each pipeline stage: W + B A * alpha / rank, from the peft adapter directory.
    for name in ("model.layers.0.self_attn.q_proj.weight", f"model.layers.{n_layers - 1}.mlp.down_proj.weight"):
        module = name.removesuffix(".weight")
        a, b = adapter[f"base_model.model.{module}.lora_A.weight"], adapter[f"base_model.model.{module}.lora_B.weight"]
        assert b.abs().max() > 0, name  # the adapter was trained
        torch.testing.assert_close(trained[name], base[name] + (b @ a) * scale, rtol=0, atol=1e-6)
        assert not torch.equal(trained[name], base[name])


def test_sft_with_lora_resumes_exactly(sft_lora_run, tmp_path):
    """Everything after the step-1 checkpoint dropped, the launch again: step 2 draws the same batch
    and reaches the same loss, adapters and merged export."""
    from safetensors.torch import load_file

    first, out = sft_lora_run["out"], tmp_path / "run"
    shutil.copytree(first, out)
    shutil.rmtree(out / "checkpoints" / "step_000002")
    shutil.rmtree(out / "model")
    overrides = [o for o in sft_lora_run["overrides"] if not o.startswith("output.dir=")] + [f"output.dir={out}"]
    res = subprocess.run(["bash", str(REPO / "launch" / "sft.sh"), str(SFT_CONFIG), *overrides], cwd=REPO,
                         env=dict(os.environ, RLFT_PROGRESS="0"), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "resuming from" in res.stderr and "(step 1)" in res.stderr
    original, resumed = read_steps(first), read_steps(out)
    assert [s["step"] for s in resumed] == [1, 2]
    assert resumed[1]["loss"] == pytest.approx(original[1]["loss"], rel=1e-5)
    assert resumed[1]["grad_norm"] == pytest.approx(original[1]["grad_norm"], rel=1e-4)
    a, b = adapter_weights(first), adapter_weights(out)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    merged = [{k: v for f in sorted((run / "model").glob("*.safetensors")) for k, v in load_file(f).items()}
              for run in (first, out)]
    assert merged[0].keys() == merged[1].keys()
    assert all(torch.allclose(merged[0][k], merged[1][k], atol=1e-6) for k in merged[0])
