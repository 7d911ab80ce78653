"""The starting model's family, checked before any rank starts (torch-free).

:func:`check_lora_targets` (from :func:`rlft.config.checks.validate`): ``model.lora.target_modules``
names projections some family has.  :func:`check_model_family` (from :mod:`rlft.config.preflight`),
where the model's ``config.json`` is on this machine: the policy pipeline can split its family
(:mod:`rlft.models.families`), the sampler's engine serves it, its attention runs as the family needs,
and LoRA's targets are its projections.  Each refusal is one line naming the key and the fix.
"""
from __future__ import annotations

from pathlib import Path

from rlft.config.schema import ConfigError
from rlft.engines import BACKENDS, candidates
from rlft.models.families import UnsupportedFamily, family_of, lora_target_names, read_config_json


def check_lora_targets(cfg) -> None:
    """Refuse LoRA targets that name no projection of any registered family (peft would adapt the
    others and leave these out without a word)."""
    known = lora_target_names()
    unknown = [t for t in cfg.model.lora.target_modules if t not in known]
    if unknown:
        raise ConfigError(f"model.lora.target_modules: {', '.join(map(repr, unknown))} names no linear layer of a "
                          f"decoder layer (the families' projections: {', '.join(known)})")


def check_model_family(cfg, model_dir: Path | None) -> None:
    """Refuse a starting model (its ``config.json`` in ``model_dir``; None: not here yet, the ranks
    check) whose family the pipeline cannot split or the chosen engine cannot serve."""
    config = read_config_json(model_dir) if model_dir is not None else None
    if config is None or "model_type" not in config:  # no model's config: the ranks' loading says so
        return
    key = "output.init_checkpoint" if cfg.output.init_checkpoint else "model.path"
    try:
        family = family_of(config)
    except UnsupportedFamily as e:
        raise ConfigError(f"{key}: {model_dir}: {e}") from None
    if cfg.model.attn_implementation != "eager" and family.capped_attention(config):
        raise ConfigError(f"model.attn_implementation: {family.model_type} soft-caps its attention logits "
                          f"({family.attention_softcap}), which only eager attention applies: set "
                          f"model.attn_implementation=eager")
    if family.aux_loss_weight(config) and cfg.model.activation_checkpointing:
        raise ConfigError(f"model.activation_checkpointing: {model_dir}'s config adds its routers' load-balancing loss "
                          f"({family.aux_loss_switch}, {family.aux_loss_coef}), which the pipeline computes without "
                          f"activation checkpointing only; set model.activation_checkpointing=false or "
                          f"{family.aux_loss_switch}: false in its config.json")
    choices = candidates(cfg.sampling.backend)
    refusals = [why for why in (b.refuses_family(family) for b in choices) if why]
    if len(refusals) == len(choices):  # auto falls back to an engine that serves it, where one does
        able = [b.name for b in BACKENDS.values() if not b.refuses_family(family)]
        raise ConfigError(f"sampling.backend: {refusals[0]}; set sampling.backend={' or '.join(able) or '?'}")
    lora = cfg.model.lora
    wrong = [t for t in lora.target_modules if t not in family.lora_targets]
    if lora.enabled and wrong:
        raise ConfigError(f"model.lora.target_modules: {', '.join(map(repr, wrong))} names no projection of "
                          f"{family.model_type}'s decoder layers; LoRA may adapt {', '.join(family.lora_targets)}")
