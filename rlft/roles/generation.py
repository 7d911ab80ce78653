"""Generation and grading: `group_size` responses to each prompt from the engine, and their rewards.

Prompts are tokenised once here; the engine returns response token ids, so the trainer never
re-tokenises model text.  Responses are laid out group-major: the `group_size` responses to
prompt i sit at rows [i * group_size, (i + 1) * group_size).  `RolloutGenerator.grade` is the one
place rewards of training responses are computed.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from rlft.config import RunConfig
from rlft.data import Example
from rlft.engines.base import RolloutEngine, sampling_spec
from rlft.prompts import prompt_of
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
    """Samples `grpo.group_size` responses per prompt with `engine` and grades them (`reward.fn`)."""

    def __init__(self, cfg: RunConfig, engine: RolloutEngine, tokenizer):
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.group_size = cfg.grpo.group_size
        default_grader().start()  # warm the grading workers now, not in the first step
        self.reward_fn = make_reward_fn(cfg.reward.fn, cfg.reward.format_weight, timeout_s=cfg.reward.timeout_s,
                                        answer_format=cfg.reward.answer_format)
        self.prompt = prompt_of(cfg)

    def generate(self, examples: list[Example], seed: int, keep_awake: bool = False,
                 logprobs: bool = False) -> Rollout:
        """`group_size` responses to each example's prompt (the engine stays awake with `keep_awake`,
        for another round of the same step), with each token's log-prob when `logprobs`."""
        prompts = [self.prompt.render(ex.question, self.tokenizer) for ex in examples]
        prompt_ids = self.prompt.encode([ex.question for ex in examples], self.tokenizer)
        self.engine.wake()
        groups = self.engine.generate(prompt_ids, sampling_spec(self.cfg.sampling, n=self.group_size, seed=seed,
                                                                logprobs=logprobs))
        out = Rollout.empty()
        for ex, text, ids, group in zip(examples, prompts, prompt_ids, groups):
            if len(group) != self.group_size:
                raise RuntimeError(f"rollout engine returned {len(group)} completions for a prompt, "
                                   f"expected {self.group_size}")
            for c in group:
                if logprobs and c.logprobs is None:
                    raise RuntimeError(f"{type(self.engine).__name__} returned no log-probs; the trainer needs "
                                       "the sampler's log-prob of every response token (Completion.logprobs)")
                out.example_indices.append(ex.index)
                out.prompt_ids.append(ids)
                out.response_ids.append(list(c.token_ids))
                out.responses.append(c.text)
                out.ground_truths.append(ex.ground_truth)
                out.finish_reasons.append(c.finish_reason)
                out.prompts.append(text)
                out.logprobs.append(list(c.logprobs) if logprobs else None)
        return out

    def grade(self, rollout: Rollout) -> tuple[list[dict], dict]:
        """The reward of every response (`reward.fn`, by default `r1_zero_reward_fn`: format +
        answer; plus `reward.format_weight` x format), and the grader's counts for the log."""
        grades = self.reward_fn(rollout.responses, rollout.ground_truths)
        stats = self.reward_fn.last_batch_stats
        return grades, {f"grader/{k}": float(getattr(stats, k)) for k in GRADER_COUNTERS}
