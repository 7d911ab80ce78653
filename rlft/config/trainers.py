"""The trainers, one record each: what the launch and the checks read about a trainer, never its name
or its module's name.

    TRAINERS  grpo (rlft.train_grpo, launch/train.sh), sft (rlft.train_sft, launch/sft.sh)

`launch/train.sh` and `launch/sft.sh` name their trainer (`launch/_launch.sh grpo ...`);
`rlft.config.launch_plan --trainer NAME` finds its record, runs the checks that apply to it
(`rlft.config.preflight.preflight`) and tells the launcher which module every rank runs.  A
trainer from outside rlft is one `register_trainer(Trainer(...))` in a module named in `plugins:`
(imported as the config is loaded, before the record is looked up).  Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rlft.common import add_record
from rlft.config.errors import ConfigError
from rlft.config.inputs import check_sft_examples
from rlft.config.learnable import check_prompt_asks_for_the_format, check_reward_fn
from rlft.config.preflight import (check_answer_budget_of_start_model, check_first_turn_of_start_model, check_grpo_can_learn,
                                   check_teacher_model)


@dataclass(frozen=True)
class Trainer:
    """A trainer and what the launch and the checks need to know about it.

    * ``name``: how the launch scripts name it (``launch/_launch.sh NAME``, ``--trainer NAME``).
    * ``module``: what every rank runs (``deepspeed --module MODULE``); its ``main`` takes
      ``--config X.yaml [key=value ...]``.
    * ``launcher``: the script that launches it, named when a rank finds the wrong number of ranks.
    * ``rollouts``: it samples training rollouts, so the sampler role is built (GRPO); without, the
      sampler's rank holds the trainer's data (SFT's feeder) and only the evaluator runs an engine.
    * ``train_size(cfg)``: the rows of the train split it reads (None: all of them).
    * ``rows_per_step(cfg)``: the distinct training rows one step draws (None: any one row will do);
      a local training file with fewer usable rows is refused before any rank starts, naming
      ``rows_per_step_from``, the settings that make the number (the first one is the one to lower).
    * ``config_checks``: functions ``(cfg) -> None`` raising `ConfigError` for settings (and models
      beside the starting one) this trainer cannot run with; run right after the starting model's
      checks, before the output directory and the data are looked at (and by ``--check-config``).
    * ``input_checks``: functions ``(cfg) -> None`` raising `ConfigError` for its inputs (the data,
      the reward function, the token budget), run after the checks every trainer shares.
    """

    name: str
    module: str
    launcher: str
    rollouts: bool
    train_size: Callable[[Any], int | None]
    rows_per_step: Callable[[Any], int | None] = lambda cfg: None
    rows_per_step_from: str = ""
    config_checks: tuple[Callable[[Any], None], ...] = ()
    input_checks: tuple[Callable[[Any], None], ...] = ()

    def check_config(self, cfg) -> None:
        """Its own checks of the settings alone (ConfigError naming the key)."""
        for check in self.config_checks:
            check(cfg)


def check_sft_config(cfg) -> None:
    """What SFT needs of a config beyond `rlft.config.validate`.

    The data lives on the sampler's rank, which must also be the evaluator's: weight syncs go to
    the sampler's and the evaluator's ranks, and in SFT only the evaluator has an engine to fill.
    SFT's batch must split into replicas x micro-batches like the GRPO batch does.
    """
    t, micro, bs = cfg.topology, cfg.optim.train_micro_batch_size, cfg.sft.batch_size
    if t.sampler_rank != t.evaluator_rank:
        raise ConfigError(f"topology.sampler_rank: SFT keeps its training data on the evaluator's rank; set "
                          f"topology.sampler_rank={t.evaluator_rank} (the evaluator_rank), got {t.sampler_rank}")
    replicas = len(t.policy_ranks) // t.pipeline_stages
    if bs % replicas or (bs // replicas) % micro:
        raise ConfigError(f"sft.batch_size: {bs} must split evenly into {replicas} data-parallel replica(s) x "
                          f"micro-batches of optim.train_micro_batch_size={micro}")


TRAINERS: dict[str, Trainer] = {t.name: t for t in (
    Trainer("grpo", "rlft.train_grpo", "launch/train.sh", rollouts=True,
            train_size=lambda cfg: cfg.data.train_size,
            rows_per_step=lambda cfg: cfg.optim.rollout_batch_size // cfg.grpo.group_size,
            rows_per_step_from="optim.rollout_batch_size / grpo.group_size",
            config_checks=(check_grpo_can_learn, check_teacher_model),
            # a run that would exit 0 having learnt nothing (rlft/config/learnable.py)
            input_checks=(check_answer_budget_of_start_model, check_first_turn_of_start_model, check_reward_fn,
                          check_prompt_asks_for_the_format)),
    Trainer("sft", "rlft.train_sft", "launch/sft.sh", rollouts=False,
            train_size=lambda cfg: cfg.sft.train_size,
            config_checks=(check_sft_config,), input_checks=(check_sft_examples,)),
)}


def register_trainer(trainer: Trainer) -> Trainer:
    """Add a trainer that is not one of rlft's own (a plugin's, a test's)."""
    return add_record(TRAINERS, trainer, "trainer")


def trainer_named(name: str | None = None, module: str | None = None) -> Trainer | None:
    """The record of the trainer called `name`, or of the one whose module is `module`; None when
    neither is given; ConfigError naming the registered ones when no record matches."""
    if name is None and module is None:
        return None
    found = [t for t in TRAINERS.values() if name in (None, t.name) and module in (None, t.module)]
    if not found:
        given = f"trainer {name!r}" if name is not None else f"trainer module {module!r}"
        raise ConfigError(f"{given} is not registered: one of {', '.join(f'{t.name} ({t.module})' for t in TRAINERS.values())}"
                          f", or a trainer registered by a module named in plugins:")
    return found[0]
