"""The rollout role (the sampler): prompts -> grouped rollouts -> rewards -> advantages -> the batch.

Prompts are tokenised once here; the engine returns response token ids, so the trainer never
re-tokenises model text.  Responses are laid out group-major: the `group_size` responses to
prompt i sit at rows [i * group_size, (i + 1) * group_size).

`RolloutWorker.collect` is the one place the step's training data comes from, and `grade` the one
place rewards are computed: filtering or resampling groups, other reward functions and
asynchronous rollouts belong in these two methods.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from rlft.batch import RolloutBatch, build_rollout_batch
from rlft.common import log
from rlft.config import RunConfig, SamplingConfig
from rlft.data import Example, PromptSampler, load_examples
from rlft.engines.base import RolloutEngine, SamplingSpec
from rlft.grader import default_grader
from rlft.grpo import compute_group_normalized_rewards
from rlft.prompts import format_prompt

Timer = Callable[[str], AbstractContextManager]


@dataclass
class Rollout:
    example_indices: list[int]  # per response
    prompt_ids: list[list[int]]  # per response (repeated within a group)
    response_ids: list[list[int]]
    responses: list[str]
    ground_truths: list[str]
    finish_reasons: list[str]
    prompts: list[str]  # per response


def sampling_spec(cfg: SamplingConfig, *, n: int, seed: int | None, evaluation: bool = False) -> SamplingSpec:
    """The engine's sampling parameters from the config (evaluation: greedy by default)."""
    return SamplingSpec(
        temperature=cfg.eval_temperature if evaluation else cfg.temperature,
        top_p=1.0 if evaluation and cfg.eval_temperature == 0 else cfg.top_p,
        min_tokens=cfg.min_tokens,
        max_tokens=(cfg.eval_max_tokens or cfg.max_tokens) if evaluation else cfg.max_tokens,
        stop=list(cfg.stop), include_stop_str_in_output=cfg.include_stop_str_in_output,
        repetition_penalty=cfg.repetition_penalty, n=n, seed=seed)


def _untimed(phase: str) -> AbstractContextManager:
    return nullcontext()


class RolloutWorker:
    """Draws each step's prompts (seeded, resumable), samples `group_size` responses per prompt
    with `engine`, grades them and turns them into the policy's batch."""

    def __init__(self, cfg: RunConfig, engine: RolloutEngine, tokenizer):
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.group_size = cfg.grpo.group_size
        self.grader = default_grader()
        self.grader.start()  # warm the grading workers now, not in the first step
        self.examples = load_examples(cfg.data.source, cfg.data.train_split, size=cfg.data.train_size,
                                      seed=cfg.seed).examples
        prompts_per_step = cfg.optim.rollout_batch_size // self.group_size
        self.prompts = PromptSampler(len(self.examples), prompts_per_step, cfg.seed, shuffle=cfg.data.shuffle)
        log.info("sampler: %d training prompts (%s), %d per step, engine %s", len(self.examples),
                 cfg.data.source, prompts_per_step, type(engine).__name__)

    # ------------------------------------------------------------------ the step's batch

    def collect(self, step: int, timed: Timer = _untimed) -> tuple[RolloutBatch, dict]:
        """The step's graded batch with its advantages, and what to log about it (timed as the
        phases "sample" and "grade")."""
        cfg = self.cfg
        with timed("sample"):
            indices = self.prompts.next_batch()
            rollout = self.generate([self.examples[i] for i in indices], seed=cfg.seed * 1_000_003 + step)
        with timed("grade"):
            grades, metrics = self.grade(rollout)
            batch, reward_stats = self.to_batch(rollout, grades)
            metrics["epoch_ended"] = self.prompts.epoch_done
        metrics.update(rollout_metrics(rollout, grades, batch, reward_stats))
        metrics["prompt_indices"] = indices
        every = cfg.schedule.log_samples_every
        if every and step % every == 0:
            metrics["samples"] = self.samples(indices, rollout, grades)
        return batch, metrics

    def generate(self, examples: list[Example], seed: int) -> Rollout:
        """`group_size` responses to each example's prompt."""
        prompts = [format_prompt(ex.question, self.cfg.data.prompt_template) for ex in examples]
        prompt_ids = [list(ids) for ids in self.tokenizer(prompts)["input_ids"]]
        self.engine.wake()
        groups = self.engine.generate(prompt_ids, sampling_spec(self.cfg.sampling, n=self.group_size, seed=seed))
        if self.cfg.sampling.vllm.sleep_mode:
            self.engine.sleep()  # give the GPU's memory to the policy until the next sync
        out = Rollout([], [], [], [], [], [], [])
        for ex, text, ids, group in zip(examples, prompts, prompt_ids, groups):
            if len(group) != self.group_size:
                raise RuntimeError(f"rollout engine returned {len(group)} completions for a prompt, "
                                   f"expected {self.group_size}")
            for c in group:
                out.example_indices.append(ex.index)
                out.prompt_ids.append(ids)
                out.response_ids.append(list(c.token_ids))
                out.responses.append(c.text)
                out.ground_truths.append(ex.ground_truth)
                out.finish_reasons.append(c.finish_reason)
                out.prompts.append(text)
        return out

    def grade(self, rollout: Rollout) -> tuple[list[dict], dict]:
        """The reward of every response (`r1_zero_reward_fn`: format + answer), and the grader's
        counts for the log."""
        grades = self.grader.grade_batch(rollout.responses, rollout.ground_truths)
        stats = self.grader.last_batch_stats
        return grades, {f"grader/{k}": float(getattr(stats, k))
                        for k in ("symbolic", "timed_out", "rejected", "unfinished", "crashed")}

    def to_batch(self, rollout: Rollout, grades: list[dict]) -> tuple[RolloutBatch, dict]:
        """Group-normalised advantages and the padded batch the policy trains on."""
        g, tok = self.cfg.grpo, self.tokenizer
        rewards = torch.tensor([grade["reward"] for grade in grades], dtype=torch.float32)
        advantages, raw_rewards, reward_stats = compute_group_normalized_rewards(
            rewards, g.group_size, g.advantage_eps, g.normalize_by_std)
        batch = build_rollout_batch(rollout.prompt_ids, rollout.response_ids, pad_token_id=tok.pad_token_id,
                                    eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                    padding_side=self.cfg.model.padding_side)
        batch.advantages, batch.raw_rewards = advantages, raw_rewards
        return batch, reward_stats

    def samples(self, indices: list[int], rollout: Rollout, grades: list[dict]) -> list[dict]:
        """A few completions, spread over the batch, for the log."""
        n = self.cfg.schedule.num_logged_samples
        return [{"question": self.examples[indices[i // self.group_size]].question, "response": rollout.responses[i],
                 "ground_truth": rollout.ground_truths[i], **grades[i]}
                for i in range(0, len(grades), max(1, len(grades) // n))][:n]

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        return self.prompts.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state)


def rollout_metrics(rollout: Rollout, grades: list[dict], batch: RolloutBatch, reward_stats: dict) -> dict:
    resp_len = batch.response_mask.sum(-1).float()
    n = max(1, len(grades))
    out = {
        "reward/mean": sum(g["reward"] for g in grades) / n,
        "reward/format": sum(g["format_reward"] for g in grades) / n,
        "reward/answer": sum(g["answer_reward"] for g in grades) / n,
        "response_length/mean": float(resp_len.mean()),
        "response_length/max": float(resp_len.max()),
        "response_length/clipped_fraction": sum(r == "length" for r in rollout.finish_reasons) / n,
        "tokens/response": float(batch.response_mask.sum()),
        "tokens/total": float(batch.attention_mask.sum()),
    }
    for k, v in reward_stats.items():
        if isinstance(v, (int, float)) or (torch.is_tensor(v) and v.numel() == 1):
            out[f"batch/{k}"] = float(v)
    return out
