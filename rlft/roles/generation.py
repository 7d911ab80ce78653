"""Generation and grading: `group_size` responses to each prompt from the engine, and their rewards.

Every response is an episode of the run's environment (`environment.name`; `single_turn` by default),
played by `rlft.envs.rollouts.play_rows`: prompts are the environment's openings, tokenised once; the
engine returns response token ids, so the trainer never re-tokenises model text.  A single-turn
episode is one completion of the step's one engine call (n = group_size); a multi-turn one (e.g.
`calculator`) holds the model's turns with the tool replies between them, its `response_mask` keeping
the replies out of the loss, its last turn graded.  Responses are laid out group-major: the
`group_size` responses to prompt i sit at rows [i * group_size, (i + 1) * group_size).
`RolloutGenerator.grade` is the one place rewards of training responses are computed.
"""
from __future__ import annotations

from rlft.config import RunConfig
from rlft.data import Example
from rlft.data.prompts import prompt_of
from rlft.engines.base import RolloutEngine, sampling_spec
from rlft.envs.demonstrations import training_environment
from rlft.envs.registry import environment_record
from rlft.envs.rollout_options import add_tool_reward
from rlft.envs.rollouts import RolloutRow, episode_budget, play_rows
from rlft.reward.functions import make_reward_fn
from rlft.reward.grader import default_grader

# Grader counters logged per step as grader/<name>.
GRADER_COUNTERS = ("symbolic", "custom", "errors", "timed_out", "rejected", "unfinished", "crashed")

# A step's responses: one row each, group-major.
Rollout = list[RolloutRow]


class RolloutGenerator:
    """Samples `grpo.group_size` responses per prompt with `engine` (episodes of the run's environment)
    and grades them (`reward.fn`)."""

    def __init__(self, cfg: RunConfig, engine: RolloutEngine, tokenizer):
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.group_size = cfg.grpo.group_size
        default_grader().start()  # warm the grading workers now, not in the first step
        self.reward_fn = make_reward_fn(cfg.reward.fn, cfg.reward.format_weight, timeout_s=cfg.reward.timeout_s,
                                        answer_format=cfg.reward.answer_format)
        self.prompt = prompt_of(cfg)
        e = cfg.environment
        self.environment = training_environment(cfg, self.prompt)  # with environment.demonstrations
        # Whether the logs describe episodes (turns, tool calls, transcripts) or plain responses.
        self.multi_turn = environment_record(e.name).multi_turn
        self.episode_tokens = episode_budget(self.multi_turn, cfg.sampling.max_tokens, e.max_episode_tokens)

    def generate(self, examples: list[Example], seed: int, keep_awake: bool = False,
                 logprobs: bool = False) -> Rollout:
        """`group_size` responses to each example's prompt (the engine stays awake with `keep_awake`,
        for another round of the same step), with each token's log-prob when `logprobs`."""
        spec = sampling_spec(self.cfg.sampling, n=self.group_size, seed=seed, logprobs=logprobs)
        self.engine.wake()
        e = self.cfg.environment
        groups = play_rows(self.engine, self.environment, examples, spec, self.tokenizer, max_turns=e.max_turns,
                           max_episode_tokens=self.episode_tokens)
        for group in groups:
            self._check_group(group, logprobs)
        return [row for group in groups for row in group]

    def _check_group(self, group: list[RolloutRow], logprobs: bool) -> None:
        if len(group) != self.group_size:
            raise RuntimeError(f"rollout engine returned {len(group)} completions for a prompt, "
                               f"expected {self.group_size}")
        if logprobs and any(row.logprobs is None for row in group):
            raise RuntimeError(f"{type(self.engine).__name__} returned no log-probs; the trainer needs "
                               "the sampler's log-prob of every response token (Completion.logprobs)")

    def grade(self, rollout: Rollout) -> tuple[list[dict], dict]:
        """The reward of every response (`reward.fn`, by default `r1_zero_reward_fn`: format +
        answer; plus `reward.format_weight` x format), and the grader's counts for the log."""
        grades = self.reward_fn([row.text for row in rollout], [row.example.ground_truth for row in rollout],
                                [row.example.question for row in rollout])
        stats = self.reward_fn.last_batch_stats
        for grade, row in zip(grades, rollout):
            if row.episode.reward is not None:  # the environment's own reward
                grade["reward"] = float(row.episode.reward)
        add_tool_reward(self.cfg.reward, grades, [row.episode for row in rollout])  # reward.tool_reward
        return grades, {f"grader/{k}": float(getattr(stats, k)) for k in GRADER_COUNTERS}
