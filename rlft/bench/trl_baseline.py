"""The baseline: TRL's ``GRPOTrainer`` on the same model, prompts, lengths and batch as an rlft run.

The benchmark writes a spec (JSON) and starts this module in its own process(es) (``torchrun`` on
GPUs, one process per GPU, each with a colocated vLLM: ``use_vllm=True, vllm_mode="colocate"``):

    python -m rlft.bench.trl_baseline SPEC.json

One TRL optimizer step does what one rlft step does: ``prompts x num_generations`` completions of
forced length generated once (``generation_batch_size`` = the whole batch), graded by the same
reward function, one pass of micro-batches with gradient accumulation, one AdamW step, fresh weights
into vLLM.  It writes OUT/trl_steps.jsonl: per optimizer step its wall seconds (between the
trainer's ``on_step_end`` callbacks), TRL's own logged metrics and TRL's profiling timers.

TRL is not a dependency of rlft: without it (or, on a GPU, without vLLM) the baseline is skipped
with a message.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any


def trl_unavailable_reason(use_vllm: bool) -> str | None:
    """Why the baseline cannot run here (None: it can)."""
    if importlib.util.find_spec("trl") is None:
        return "trl is not installed (pip install trl); the baseline is skipped"
    if importlib.util.find_spec("datasets") is None:
        return "datasets is not installed (TRL needs it); the baseline is skipped"
    from rlft.engines.vllm_backend import VLLM

    if use_vllm and not VLLM.installed():
        return "vllm is not installed; TRL's vLLM colocate baseline is skipped"
    return None


def grpo_config_kwargs(spec: dict, known_fields: set[str] | None = None) -> tuple[dict[str, Any], list[str]]:
    """``GRPOConfig`` arguments for the spec's workload, and the names left out because this TRL
    version has no such field (``known_fields``: the fields of the installed ``GRPOConfig``)."""
    w = spec["workload"]
    per_device, grad_acc = _batch_split(w, spec["num_processes"])
    s = spec["sampling"]
    use_vllm = spec["use_vllm"]
    # Forced lengths: at least max_completion_length tokens, whatever the model writes.
    min_key = "min_tokens" if use_vllm else "min_new_tokens"
    kwargs: dict[str, Any] = {
        "output_dir": spec["out_dir"],
        "max_steps": spec["steps"],
        "seed": spec["seed"],
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "bf16": spec["bf16"],
        "use_cpu": not spec["gpu"],
        # the batch: one generation of every completion per optimizer step
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": grad_acc,
        "steps_per_generation": grad_acc,
        "num_generations": w["group_size"],
        "shuffle_dataset": False,  # the prompts come in rlft's order
        "max_completion_length": w["tokens"],
        "max_prompt_length": None,  # older TRL truncates prompts by default
        "generation_kwargs": {min_key: w["tokens"]},
        "temperature": s["temperature"],
        "top_p": s["top_p"],
        "repetition_penalty": s["repetition_penalty"],
        **_update_kwargs(spec),
        # generation: vLLM in the training process, sharing its GPU
        "use_vllm": use_vllm,
    }
    if use_vllm:
        kwargs.update(_vllm_colocate_kwargs(spec["vllm_options"]))
    if known_fields is None:
        return kwargs, []
    dropped = sorted(k for k in kwargs if k not in known_fields)
    return {k: v for k, v in kwargs.items() if k in known_fields}, dropped


def _update_kwargs(spec: dict) -> dict[str, Any]:
    """The ``GRPOConfig`` arguments of the update: rlft's optimizer, schedule, loss and advantage
    settings, as TRL names them."""
    from rlft.grpo import ADVANTAGE_ESTIMATORS

    opt, g = spec["optim"], spec["grpo"]
    aggregation_to_loss = {"sequence": "grpo", "constant": "dr_grpo", "token": "dapo"}
    return {
        # the update: rlft's defaults
        "learning_rate": opt["lr"],
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "adam_beta1": opt["betas"][0],
        "adam_beta2": opt["betas"][1],
        "adam_epsilon": opt["eps"],
        "weight_decay": opt["weight_decay"],
        "max_grad_norm": opt["grad_clip"],
        "beta": g["kl_coef"],
        "epsilon": g["cliprange"],
        "num_iterations": g["epochs_per_rollout"],
        "loss_type": aggregation_to_loss.get(g["aggregation"], "grpo"),
        "scale_rewards": "group" if ADVANTAGE_ESTIMATORS[g["advantage_estimator"]].divides_by_std else "none",
        "gradient_checkpointing": spec["activation_checkpointing"],
        "disable_dropout": True,
        "log_completions": False,
    }


def _batch_split(w: dict, nproc: int) -> tuple[int, int]:
    """(completions per device per micro-batch, gradient accumulation steps) that make one
    optimizer step of the workload's ``prompts x group_size`` completions over ``nproc`` processes;
    a ValueError when they do not split evenly."""
    responses = w["prompts"] * w["group_size"]
    per_device = w["micro_batch"]
    if responses % (per_device * nproc):
        raise ValueError(f"{responses} completions per step do not split into {nproc} process(es) x "
                         f"micro-batches of {per_device}")
    return per_device, responses // (per_device * nproc)


def _vllm_colocate_kwargs(vllm_options: dict) -> dict[str, Any]:
    """The ``GRPOConfig`` arguments of generating with vLLM in the training process, sharing its
    GPU, with the settings rlft's vLLM engine takes from the config (``vllm_options``)."""
    return {
        "vllm_mode": "colocate",
        "vllm_gpu_memory_utilization": vllm_options["gpu_memory_utilization"],
        "vllm_enable_sleep_mode": vllm_options["enable_sleep_mode"],
        # rlft applies no importance-sampling correction between vLLM's and the trainer's log-probs
        "vllm_importance_sampling_correction": False,
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    import dataclasses

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rlft.models.loading import ensure_pad_token

    out = Path(spec["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    kwargs, dropped = grpo_config_kwargs(spec, {f.name for f in dataclasses.fields(GRPOConfig)})
    args = _grpo_config(GRPOConfig, kwargs, out)
    reward = _rlft_reward(spec["reward"])
    data = Dataset.from_list(spec["prompts"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    ensure_pad_token(tokenizer)
    tokenizer.padding_side = "left"

    times = _step_times(_keep_profiling_timings())
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=[reward], args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[times])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    if trainer.is_world_process_zero():
        with open(out / "trl_steps.jsonl", "w") as f:
            for row in times.rows:
                f.write(json.dumps({**row, "logs": times.logs.get(row["step"], {})}) + "\n")
        (out / "trl_run.json").write_text(json.dumps({"args": kwargs, "dropped_args": dropped,
                                                      "train_wall_s": wall}, indent=1, default=str))


def _grpo_config(config_cls, kwargs: dict[str, Any], out: Path):
    """The installed TRL's ``GRPOConfig`` of ``kwargs``.  An older TRL takes ``scale_rewards`` as a
    bool: then ``kwargs["scale_rewards"]`` becomes False (in place, so the run's record says so)."""
    if kwargs.get("scale_rewards") == "none":
        try:
            config_cls(**{**kwargs, "output_dir": str(out / "probe")})
        except (ValueError, TypeError):  # older TRL: a bool
            kwargs["scale_rewards"] = False
    return config_cls(**kwargs)


def _rlft_reward(reward_spec: dict):
    """rlft's reward function of the spec, as a TRL reward function (named ``rlft_reward``)."""
    from rlft.reward.functions import make_reward_fn

    reward = make_reward_fn(reward_spec["fn"], reward_spec["format_weight"], timeout_s=reward_spec["timeout_s"])

    def rlft_reward(completions, ground_truth, **_kw) -> list[float]:
        return [float(r["reward"]) for r in reward(list(completions), list(ground_truth))]

    rlft_reward.__name__ = "rlft_reward"
    return rlft_reward


def _keep_profiling_timings() -> list[tuple[str, float]]:
    """A list that every TRL profiling timer appends its ``(name, seconds)`` to from now on (TRL's
    timers report only to experiment trackers); it stays empty where TRL has no such timers."""
    timings: list[tuple[str, float]] = []
    try:
        from trl.extras import profiling

        original = profiling.ProfilingContext._log_metrics

        def keep(self, duration):
            timings.append((self.name, duration))
            return original(self, duration)

        profiling.ProfilingContext._log_metrics = keep
    except (ImportError, AttributeError):
        pass
    return timings


def _step_times(timings: list[tuple[str, float]]):
    """A trainer callback that records, per optimizer step, its wall seconds (between
    ``on_step_end`` calls), the profiling timers' seconds summed by name (taking them out of
    ``timings``) in ``rows``, and TRL's logged numbers by step in ``logs``."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.t = time.perf_counter()
            self.logs: dict[int, dict] = {}
            self.rows: list[dict] = []

        def on_train_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.setdefault(state.global_step, {}).update(
                {k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))})

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            prof: dict[str, float] = {}
            for name, d in timings:
                prof[name] = prof.get(name, 0.0) + d
            timings.clear()
            self.rows.append({"step": state.global_step, "time/step": now - self.t, "profiling": prof})
            self.t = now

    return StepTimes()


if __name__ == "__main__":
    main()
