"""The run's configuration: what a YAML file and `key=value` overrides may say, and every rule about it.

    loading.py       load_config / build_config / save_config: YAML + overrides -> a validated RunConfig
    schema.py        the typed sections (dataclasses with named defaults), every one found here
    errors.py        ConfigError: a configuration mistake, its message naming the key path
    sampling_sections.py  the sampling: section, and each engine's own settings (sampling.<engine>)
    run_sections.py  the schedule:, topology:, output: and reporting: sections
    checks.py        validate(): ranges and the rules across fields, read from the choices' records
    distill_sections.py  the teacher: and distill: sections (on-policy distillation)
    distill_checks.py  teacher: and distill: (signal, teacher, ranges); the teacher's tokenizer against the student's
    topology_checks.py  the topology's rules: roles' ranks, pipelines, nodes, the batch over replicas
    plugins.py       plugins: the user's modules, imported before the checks so their choices are known
    topology.py      which rank hosts which role, from `topology:`
    role_records.py  ROLES: one record per role (the topology key that places it, whether a run builds
                     it, its builder, where a rank keeps it); build_roles and the checks read them
    preflight.py     what can be refused before any rank starts (model path, init checkpoint, data)
    trainers.py      TRAINERS: one record per trainer (grpo, sft): its module, launcher, the checks that
                     apply to it, whether it samples rollouts; the launch and preflight read them
    learnable.py     runs that would learn nothing: a reward.fn blind to the answer, a token budget below any answer
    context_budget.py  an episode's budget after its prompt; no first-turn prompt (the environment's opening) fits
    inputs.py        the run's inputs at launch: data splits and files, the environment, model files, W&B
    hub_cache.py     whether a hub id is cached or to be had from the hub (standard library only)
    start_model.py   output.init_checkpoint: refused, with the SFT config that makes it, when missing
    model_family.py  the starting model's family: one the pipeline splits, the engine serves, LoRA's targets
    launch_plan.py   python -m rlft.config.launch_plan: the deepspeed command a config asks for
    launchers.py     DeepSpeed's multi-node launchers: one record each, and the options it needs
    lr_schedules.py  the learning-rate schedules (optim.lr_schedule): one record each, its factor
    resume_rules.py  the checkpoints of an output directory: which one resumes, what it may change
    outdir_lock.py   one launch per output directory (OUT/.lock)

Nothing here imports torch: the launch checks a config before any rank starts without loading it.
`from rlft.config import RunConfig, load_config, ConfigError, ...` finds the loading, schema and
checks names; they are loaded on first use (PEP 562), so that importing one submodule (the engines
read `rlft.config.schema`) does not load the others.
"""
from __future__ import annotations

import importlib

__all__ = [
    "CHECKPOINT_STATE_FILE", "LAUNCHERS", "ConfigError", "DataConfig", "GRPOConfig", "ModelConfig",
    "OptimConfig", "OutputConfig", "RewardConfig", "RunConfig", "SFTConfig", "SamplingConfig", "ScheduleConfig",
    "TopologyConfig", "VLLMConfig", "build_config", "check_nodes", "check_topology", "config_warnings",
    "load_config", "load_config_or_exit", "save_config", "validate",
]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("rlft.config.loading"), name)
    globals()[name] = value
    return value
