"""The rollout role (the sampler): prompts -> grouped rollouts -> rewards -> advantages -> the batch.

Prompts are tokenised once here; the engine returns response token ids, so the trainer never
re-tokenises model text.  Responses are laid out group-major: the `group_size` responses to
prompt i sit at rows [i * group_size, (i + 1) * group_size).

`RolloutWorker.collect` is the one place the step's training data comes from, and `grade` the one
place rewards are computed: filtering or resampling groups and other reward functions belong in
these two methods.  Asynchronous rollouts (`schedule.max_staleness`) queue whole collected batches:
`next_batch` hands out the oldest, `prefetch` collects ahead with the weights the engine holds.
"""
from __future__ import annotations

from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields
from typing import Callable

import torch

from rlft.batch import RolloutBatch, build_rollout_batch
from rlft.common import log
from rlft.config import ConfigError, RunConfig, SamplingConfig
from rlft.data import Example, PromptSampler, load_examples
from rlft.dynamic_sampling import GroupPool, group_rows, informative_groups
from rlft.engines.base import RolloutEngine, SamplingSpec
from rlft.reward.grader import default_grader
from rlft.grpo import compute_group_normalized_rewards
from rlft.overlong import soft_overlong_penalty, truncated_rows
from rlft.prompts import drop_long_prompts, format_prompt
from rlft.reward.functions import make_reward_fn

Timer = Callable[[str], AbstractContextManager]
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


@dataclass
class Ahead:
    """A batch collected before its step (asynchronous rollouts)."""

    batch: RolloutBatch
    metrics: dict
    weights_step: int  # the policy step whose weights sampled it
    position: dict | None  # the prompt order's state before it was drawn (None: drawn at its own step)


def sampling_spec(cfg: SamplingConfig, *, n: int, seed: int | None, evaluation: bool = False,
                  logprobs: bool = False) -> SamplingSpec:
    """The engine's sampling parameters from the config (evaluation: greedy by default); `logprobs`:
    ask for each sampled token's log-prob (it slows vLLM's sampling 2.3x, so only where read)."""
    return SamplingSpec(
        temperature=cfg.eval_temperature if evaluation else cfg.temperature,
        top_p=1.0 if evaluation and cfg.eval_temperature == 0 else cfg.top_p,
        min_tokens=cfg.min_tokens,
        max_tokens=(cfg.eval_max_tokens or cfg.max_tokens) if evaluation else cfg.max_tokens,
        stop=list(cfg.stop), include_stop_str_in_output=cfg.include_stop_str_in_output,
        repetition_penalty=cfg.repetition_penalty, n=n, seed=seed,
        logprobs=logprobs and not evaluation)


def _untimed(phase: str) -> AbstractContextManager:
    return nullcontext()


class RolloutWorker:
    """Draws each step's prompts (seeded, resumable), samples `group_size` responses per prompt
    with `engine`, grades them and turns them into the policy's batch."""

    def __init__(self, cfg: RunConfig, engine: RolloutEngine, tokenizer, *, max_prompt_tokens: int | None = None):
        """`max_prompt_tokens`: rows whose prompt is longer are skipped and counted at load time
        (the model's positions minus the response budget; None = no limit)."""
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.group_size = cfg.grpo.group_size
        default_grader().start()  # warm the grading workers now, not in the first step
        self.reward_fn = make_reward_fn(cfg.reward.fn, cfg.reward.format_weight, timeout_s=cfg.reward.timeout_s)
        d = cfg.data
        loaded = load_examples(d.source, d.train_split, size=d.train_size, seed=cfg.seed)
        loaded = drop_long_prompts(loaded, tokenizer, d.prompt_template, max_prompt_tokens,
                                   f"{d.source} [{d.train_split}]")
        self.examples, self.skipped = loaded.examples, loaded.skipped
        prompts_per_step = cfg.optim.rollout_batch_size // self.group_size
        if len(self.examples) < prompts_per_step:
            skipped = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items()))
            raise ConfigError(
                f"data.train_size: {len(self.examples)} usable training rows in {d.source} [{d.train_split}]"
                f"{f' (skipped: {skipped})' if skipped else ''}, but every step draws optim.rollout_batch_size / "
                f"grpo.group_size = {prompts_per_step} prompts; raise data.train_size or lower "
                f"optim.rollout_batch_size")
        self.prompts = PromptSampler(len(self.examples), prompts_per_step, cfg.seed, shuffle=cfg.data.shuffle)
        # Asynchronous rollouts: batches collected ahead, oldest first, each with the step whose weights
        # the engine held when it sampled them and the prompt order's position before they were drawn.
        self.ahead: deque[Ahead] = deque()
        self.weights_step = 0  # the policy step whose weights the engine holds (0 = the starting model)
        log.info("sampler: %d training prompts (%s), %d per step, engine %s", len(self.examples),
                 cfg.data.source, prompts_per_step, type(engine).__name__)

    # ------------------------------------------------------------------ the step's batch

    @property
    def sleep_level(self) -> int:
        """How deeply the engine sleeps between steps (with `sampling.vllm.sleep_mode`).  When every
        step syncs the policy's weights into it before it generates again (`schedule.sync_every: 1`
        and no batches collected ahead), level 2: its weights are dropped, not copied to host memory
        and back (3-4 GB each way for a 1.5B model), since the sync replaces them all (its checksum
        proves it).  Otherwise level 1, which keeps them."""
        s = self.cfg.schedule
        return 2 if s.sync_every == 1 and s.max_staleness == 0 else 1

    def next_batch(self, step: int, timed: Timer = _untimed) -> tuple[RolloutBatch, dict]:
        """The batch the policy trains on at `step`: the oldest one collected ahead, or one collected
        now.  Where batches can be old (`schedule.max_staleness` > 0 or `sync_every` > 1) its metrics say
        how old: `rollout/staleness` = optimizer steps between the weights that sampled it and the
        weights that train on it (0 = on-policy)."""
        if self.ahead:
            entry = self.ahead.popleft()
        else:
            batch, metrics = self.collect(step, timed)
            entry = Ahead(batch, metrics, self.weights_step, None)
        if self.cfg.schedule.max_staleness or self.cfg.schedule.sync_every > 1:
            entry.metrics["rollout/staleness"] = float(step - 1 - entry.weights_step)
        return entry.batch, entry.metrics

    def prefetch(self, step: int, last_step: int, timed: Timer = _untimed) -> None:
        """Collect the batches of the steps after `step` (up to `last_step`) until
        `schedule.max_staleness` of them wait, with the weights the engine holds now; where the
        sampler has its own device this overlaps the policy's update of `step`."""
        while len(self.ahead) < self.cfg.schedule.max_staleness and step + len(self.ahead) < last_step:
            position = self.prompts.state_dict()
            batch, metrics = self.collect(step + len(self.ahead) + 1, timed)
            self.ahead.append(Ahead(batch, metrics, self.weights_step, position))

    def weights_synced(self, step: int) -> None:
        """The engine now holds the policy's weights after `step`."""
        self.weights_step = step

    def collect(self, step: int, timed: Timer = _untimed) -> tuple[RolloutBatch, dict]:
        """The step's graded batch with its advantages, and what to log about it (timed as the
        phases "sample" and "grade").

        Without dynamic sampling this is one round: the next prompts, `group_size` responses each.
        With `grpo.dynamic_sampling`, rounds of fresh prompts follow until the batch holds its
        number of groups with differing rewards (at most `grpo.max_sampling_rounds` rounds); the
        batch always has the configured size (see `rlft.dynamic_sampling`).
        """
        cfg, g = self.cfg, self.cfg.grpo
        rounds = g.max_sampling_rounds if g.dynamic_sampling else 1
        pool = GroupPool(target_groups=self.prompts.batch_size)
        rollout, grades, examples = Rollout.empty(), [], []
        metrics = dict.fromkeys((f"grader/{k}" for k in GRADER_COUNTERS), 0.0)
        for r in range(rounds):
            with timed("sample"):
                round_examples = [self.examples[i] for i in self.prompts.next_batch()]
                part = self.generate(round_examples, seed=cfg.seed * 1_000_003 + step + 7919 * r,
                                     keep_awake=r + 1 < rounds, logprobs=self.wants_logprobs(step))
            with timed("grade"):
                part_grades, counts = self.grade(part)
            for k, v in counts.items():
                metrics[k] += v
            rollout, grades, examples = rollout.extend(part), grades + part_grades, examples + round_examples
            pool.add_round(informative_groups(torch.tensor([x["reward"] for x in part_grades]), self.group_size))
            if pool.full:
                break
        if cfg.sampling.vllm.sleep_mode:
            self.engine.sleep(level=self.sleep_level)  # give the GPU's memory to the policy until the next sync
        if g.dynamic_sampling:
            metrics.update(pool.stats())
            metrics.update(all_rollouts_metrics(grades))
            chosen = pool.selection()
            rows = group_rows(chosen, self.group_size)
            rollout, grades, examples = rollout.select(rows), [grades[i] for i in rows], [examples[i] for i in chosen]
        with timed("grade"):
            batch, reward_stats = self.to_batch(rollout, grades)
            metrics["epoch_ended"] = self.prompts.epoch_done
        metrics.update(rollout_metrics(rollout, grades, batch, reward_stats))
        metrics.update(self.filter_overlong(batch, rollout))  # after: lengths describe what was sampled
        metrics["prompt_indices"] = [ex.index for ex in examples]
        every = cfg.schedule.log_samples_every
        if every and step % every == 0:
            metrics["samples"] = self.samples(examples, rollout, grades)
        return batch, metrics

    def wants_logprobs(self, step: int) -> bool:
        """Whether the rollouts of `step` ask the engine for log-probs: only where something reads them
        (TIS, off-policy batches, the steps that log rollout_mismatch/*; see
        `GRPOConfig.wants_sampler_logprobs`)."""
        return self.cfg.grpo.wants_sampler_logprobs(step, self.cfg.schedule.max_staleness)

    def generate(self, examples: list[Example], seed: int, keep_awake: bool = False,
                 logprobs: bool = False) -> Rollout:
        """`group_size` responses to each example's prompt (the engine stays awake with `keep_awake`,
        for another round of the same step), with each token's log-prob when `logprobs`."""
        prompts = [format_prompt(ex.question, self.cfg.data.prompt_template) for ex in examples]
        prompt_ids = [list(ids) for ids in self.tokenizer(prompts)["input_ids"]]
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

    def to_batch(self, rollout: Rollout, grades: list[dict]) -> tuple[RolloutBatch, dict]:
        """Group-normalised advantages and the padded batch the policy trains on (with the sampler's
        log-probs where they were asked for).  With `grpo.overlong: soft_penalty` the rewards are penalised for length first, so
        the advantages and `raw_rewards` include the penalty (the logged reward/* do not)."""
        g, tok = self.cfg.grpo, self.tokenizer
        rewards = torch.tensor([grade["reward"] for grade in grades], dtype=torch.float32)
        if g.overlong == "soft_penalty":
            rewards = rewards + self.overlong_penalties(rollout)
        advantages, raw_rewards, reward_stats = compute_group_normalized_rewards(
            rewards, g.group_size, g.advantage_eps, g.normalize_by_std)
        batch = build_rollout_batch(rollout.prompt_ids, rollout.response_ids, pad_token_id=tok.pad_token_id,
                                    eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                    padding_side=self.cfg.model.padding_side,
                                    response_logprobs=None if None in rollout.logprobs else rollout.logprobs)
        batch.advantages, batch.raw_rewards = advantages, raw_rewards
        return batch, reward_stats

    def overlong_penalties(self, rollout: Rollout) -> torch.Tensor:
        """`[B]` DAPO's soft overlong penalty of each response (`rlft.overlong`)."""
        g = self.cfg.grpo
        lengths = torch.tensor([len(ids) for ids in rollout.response_ids])
        return soft_overlong_penalty(lengths, self.cfg.sampling.max_tokens, g.overlong_buffer, g.overlong_penalty)

    def filter_overlong(self, batch: RolloutBatch, rollout: Rollout) -> dict:
        """With `grpo.overlong: filter`, zero the response mask of responses cut by max_tokens (in
        place); the counts of either overlong mode for the log (nothing when it is off).  The
        step's response_length/* and tokens/* (and the throughput read from them) keep counting
        what was sampled."""
        g = self.cfg.grpo
        if g.overlong == "filter":
            cut = truncated_rows(rollout.finish_reasons)
            batch.response_mask[cut] = 0.0
            return {"overlong/filtered": float(cut.sum())}
        if g.overlong == "soft_penalty":
            penalties = self.overlong_penalties(rollout)
            return {"overlong/penalised": float((penalties < 0).sum()), "overlong/penalty_mean": float(penalties.mean())}
        return {}

    def samples(self, examples: list[Example], rollout: Rollout, grades: list[dict]) -> list[dict]:
        """A few completions, spread over the batch, for the log (`examples`: one per group)."""
        n = self.cfg.schedule.num_logged_samples
        return [{"question": examples[i // self.group_size].question, "response": rollout.responses[i],
                 "ground_truth": rollout.ground_truths[i], **grades[i]}
                for i in range(0, len(grades), max(1, len(grades) // n))][:n]

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """The prompt order's position; batches collected ahead are not kept, so the position is the
        one before they were drawn: a resumed run samples those prompts again, with its own weights."""
        return self.ahead[0].position if self.ahead else self.prompts.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state)


def all_rollouts_metrics(grades: list[dict]) -> dict:
    """Rewards over every response generated in the step, kept or dropped by dynamic sampling (the
    batch's own reward/* are biased towards groups with differing rewards)."""
    n = max(1, len(grades))
    return {"dynamic_sampling/reward_all": sum(g["reward"] for g in grades) / n,
            "dynamic_sampling/format_all": sum(g["format_reward"] for g in grades) / n,
            "dynamic_sampling/answer_all": sum(g["answer_reward"] for g in grades) / n}


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
