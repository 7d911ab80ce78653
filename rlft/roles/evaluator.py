"""The evaluator role: scores the run's eval split with a resident engine during training (the
evaluation itself: :mod:`rlft.evaluate.scoring`)."""
from __future__ import annotations

from pathlib import Path

from rlft.config import ConfigError, RunConfig
from rlft.data.prompts import drop_long_prompts, prompt_of
from rlft.data.rows import load_split
from rlft.engines.base import RolloutEngine, sampling_spec
from rlft.envs.registry import DEFAULT_ENVIRONMENT, make_environment
from rlft.envs.rollouts import episode_budget, opening_lengths
from rlft.evaluate.scoring import evaluate, write_results


class Evaluator:
    """Scores the run's eval split (`data.eval_split`, `data.eval_size`) with `engine`, greedy by
    default (`sampling.eval_*`), as episodes of the run's environment (the single-turn one when
    `environment.evaluate_with_tools` is false); each evaluation is written to OUT/eval/<name>/.  The engine stays
    resident: weight syncs update it in place (it is the rollout role's when both share a rank)."""

    def __init__(self, cfg: RunConfig, engine: RolloutEngine, tokenizer, *, max_prompt_tokens: int | None = None):
        """`max_prompt_tokens`: rows whose prompt is longer are skipped and counted at load time
        (the model's positions minus the evaluation's response budget; None = no limit)."""
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        d = cfg.data
        loaded = load_split(d, d.eval_split, size=d.eval_size, seed=cfg.seed)
        self.prompt = prompt_of(cfg)
        # The same episodes as training, or with `environment.evaluate_with_tools: false` one turn, no tools.
        e = cfg.environment
        self.environment = (make_environment(e.name, self.prompt, e.options, tools=e.tools) if e.evaluate_with_tools
                            else make_environment(DEFAULT_ENVIRONMENT, self.prompt))
        lengths = (opening_lengths(self.environment, loaded.examples, tokenizer)  # the whole first-turn prompt
                   if max_prompt_tokens is not None else None)
        kept = drop_long_prompts(loaded, tokenizer, self.prompt, max_prompt_tokens, f"{d.source} [{d.eval_split}]",
                                 lengths=lengths)
        if not kept.examples:
            raise ConfigError(f"data.eval_split: none of the {len(loaded.examples)} evaluation rows of {d.source} "
                              f"[{d.eval_split}] has a prompt of at most {max_prompt_tokens} tokens (the model's "
                              f"positions minus the evaluation's response tokens)")
        self.examples, self.skipped = kept.examples, kept.skipped
        self.spec = sampling_spec(cfg.sampling, n=1, seed=cfg.seed, evaluation=True)

    def evaluate(self, name: str, *, progress: bool = False) -> dict:
        """Generate, grade and write OUT/eval/`name`/; returns the summary."""
        e = self.cfg.environment
        budget = episode_budget(self.environment.multi_turn, self.spec.max_tokens, e.max_episode_tokens)
        records, summary = evaluate(self.engine, self.tokenizer, self.examples, spec=self.spec,
                                    prompt_template=self.prompt, progress=progress, environment=self.environment,
                                    max_turns=e.max_turns, max_episode_tokens=budget)
        write_results(Path(self.cfg.output.dir) / "eval" / name, records, summary)
        return summary
