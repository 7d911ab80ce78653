"""Generation and grading: `group_size` responses to each prompt from the engine, and their rewards.

Prompts are tokenised once here; the engine returns response token ids, so the trainer never
re-tokenises model text.  Responses are laid out group-major: the `group_size` responses to
prompt i sit at rows [i * group_size, (i + 1) * group_size).  `RolloutGenerator.grade` is the one
place rewards of training responses are computed.

With a multi-turn environment (`environment.name`, e.g. `calculator`) a response is an episode
(rlft.envs.episodes): the model's turns with the tool replies between them, as tokens; its model mask
keeps the replies out of the loss, and its last turn is what is graded.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from rlft.config import RunConfig
from rlft.data import Example
from rlft.data.prompts import prompt_of
from rlft.engines.base import RolloutEngine, SamplingSpec, sampling_spec
from rlft.envs.demonstrations import with_demonstrations
from rlft.envs.episodes import TRUNCATED, EpisodeResult, open_episodes, run_episodes
from rlft.envs.registry import environment_record, make_environment
from rlft.envs.rollout_options import add_tool_reward
from rlft.reward.functions import make_reward_fn
from rlft.reward.grader import default_grader

# Grader counters logged per step as grader/<name>.
GRADER_COUNTERS = ("symbolic", "custom", "errors", "timed_out", "rejected", "unfinished", "crashed")


@dataclass
class Rollout:
    example_indices: list[int]  # per response
    prompt_ids: list[list[int]]  # per response (repeated within a group)
    response_ids: list[list[int]]
    responses: list[str]
    ground_truths: list[str]
    finish_reasons: list[str]
    prompts: list[str]  # per response
    logprobs: list[list[float] | None]  # per response token: the engine's raw log-prob (None: not asked for)
    # Per response token: 1 the model's, 0 inserted (None: single turn; the field left out: all single turn)
    model_masks: list[list[int] | None] = None
    episodes: list[EpisodeResult | None] = None  # the episode of a multi-turn environment (None: single turn)

    def __post_init__(self) -> None:
        for name in ("model_masks", "episodes"):
            if getattr(self, name) is None:
                setattr(self, name, [None] * len(self.example_indices))

    @classmethod
    def empty(cls) -> "Rollout":
        return cls(*([] for _ in fields(cls)))

    def extend(self, other: "Rollout") -> "Rollout":
        """This rollout's rows followed by `other`'s."""
        return Rollout(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def select(self, rows: list[int]) -> "Rollout":
        """The given rows, in that order."""
        return Rollout(*([getattr(self, f.name)[i] for i in rows] for f in fields(self)))


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
        self.environment = (make_environment(e.name, self.prompt, e.options)
                            if environment_record(e.name).multi_turn else None)
        self.environment = with_demonstrations(self.environment, cfg)  # environment.demonstrations

    def generate(self, examples: list[Example], seed: int, keep_awake: bool = False,
                 logprobs: bool = False) -> Rollout:
        """`group_size` responses to each example's prompt (the engine stays awake with `keep_awake`,
        for another round of the same step), with each token's log-prob when `logprobs`."""
        spec = sampling_spec(self.cfg.sampling, n=self.group_size, seed=seed, logprobs=logprobs)
        self.engine.wake()
        if self.environment is not None:
            return self.episodes(examples, spec)
        prompts = [self.prompt.render(ex.question, self.tokenizer) for ex in examples]
        prompt_ids = self.prompt.encode([ex.question for ex in examples], self.tokenizer)
        groups = self.engine.generate(prompt_ids, spec)
        out = Rollout.empty()
        for ex, text, ids, group in zip(examples, prompts, prompt_ids, groups):
            self._check_group(group, logprobs)
            for c in group:
                self._add_row(out, ex, text, ids, list(c.token_ids), c.text, c.finish_reason,
                              list(c.logprobs) if logprobs else None, None, None)
        return out

    def episodes(self, examples: list[Example], spec: SamplingSpec) -> Rollout:
        """The environment's episodes, `group_size` per example: each row's response is the whole
        episode after the prompt (model turns and tool replies), graded on its last turn's text."""
        e, tok = self.cfg.environment, self.tokenizer
        starts, prompt_ids = open_episodes(self.environment, [ex.question for ex in examples],
                                           [ex.ground_truth for ex in examples], tok)
        groups = run_episodes(self.engine, prompt_ids, starts, spec, tok, self.environment, max_turns=e.max_turns,
                              max_episode_tokens=e.episode_tokens(self.cfg.sampling.max_tokens))
        out = Rollout.empty()
        for ex, start, ids, group in zip(examples, starts, prompt_ids, groups):
            self._check_group(group, spec.logprobs)
            text = start.render(tok)
            for ep in group:
                # An episode cut by its token budget counts as cut by max_tokens (overlong handling).
                reason = "length" if ep.finish_reason in TRUNCATED else ep.finish_reason
                self._add_row(out, ex, text, ids, list(ep.token_ids), ep.text, reason,
                              list(ep.logprobs) if spec.logprobs else None, list(ep.model_mask), ep)
        return out

    def _check_group(self, group: list, logprobs: bool) -> None:
        if len(group) != self.group_size:
            raise RuntimeError(f"rollout engine returned {len(group)} completions for a prompt, "
                               f"expected {self.group_size}")
        if logprobs and any(c.logprobs is None for c in group):
            raise RuntimeError(f"{type(self.engine).__name__} returned no log-probs; the trainer needs "
                               "the sampler's log-prob of every response token (Completion.logprobs)")

    @staticmethod
    def _add_row(out: Rollout, ex: Example, prompt: str, prompt_ids: list[int], response_ids: list[int], text: str,
                 finish_reason: str, logprobs: list[float] | None, model_mask: list[int] | None,
                 episode: EpisodeResult | None) -> None:
        out.example_indices.append(ex.index)
        out.prompt_ids.append(prompt_ids)
        out.response_ids.append(response_ids)
        out.responses.append(text)
        out.ground_truths.append(ex.ground_truth)
        out.finish_reasons.append(finish_reason)
        out.prompts.append(prompt)
        out.logprobs.append(logprobs)
        out.model_masks.append(model_mask)
        out.episodes.append(episode)

    def grade(self, rollout: Rollout) -> tuple[list[dict], dict]:
        """The reward of every response (`reward.fn`, by default `r1_zero_reward_fn`: format +
        answer; plus `reward.format_weight` x format), and the grader's counts for the log."""
        grades = self.reward_fn(rollout.responses, rollout.ground_truths)
        stats = self.reward_fn.last_batch_stats
        for grade, episode in zip(grades, rollout.episodes):
            if episode is not None and episode.reward is not None:  # the environment's own reward
                grade["reward"] = float(episode.reward)
        add_tool_reward(self.cfg.reward, grades, rollout.episodes)  # reward.tool_reward
        return grades, {f"grader/{k}": float(getattr(stats, k)) for k in GRADER_COUNTERS}
