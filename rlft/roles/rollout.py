"""The rollout role (the sampler): each step's batch, from prompts to advantages.

Its parts, one job each: `PromptSource` (rlft.roles.prompt_source) draws the prompts,
`RolloutGenerator` (rlft.roles.generation) samples and grades the responses, `BatchQueue`
(rlft.roles.batch_queue) holds batches collected ahead for asynchronous rollouts.  Here:
`RolloutWorker.collect`, the one place the step's training data comes from (rounds of dynamic
sampling, overlong responses, group advantages, what is logged about it).
"""
from __future__ import annotations

import torch

from rlft.batching.batch import RolloutBatch, build_rollout_batch
from rlft.common import log
from rlft.config import RunConfig
from rlft.data import Example
from rlft.batching.dynamic_sampling import GroupPool, group_rows, informative_groups
from rlft.batching.round_size import RoundSizer
from rlft.engines.base import RolloutEngine
from rlft.envs.demonstrations import demonstration_step
from rlft.envs.metrics import episode_metrics, episode_sample
from rlft.envs.rollout_options import mask_void_episodes
from rlft.grpo import OVERLONG_MODES, compute_group_normalized_rewards
from rlft.batching.overlong import OverlongOutcome, overlong_outcome
from rlft.roles.batch_queue import BatchQueue, Timer, untimed
from rlft.roles.generation import GRADER_COUNTERS, Rollout, RolloutGenerator
from rlft.roles.prompt_source import PromptSource


ROUND_SIZE = "round_size"  # the key of the rounds' keep rate in the checkpoint's prompt position


class RolloutWorker:
    """Draws each step's prompts (seeded, resumable), samples `group_size` responses per prompt
    with `engine`, grades them and turns them into the policy's batch."""

    def __init__(self, cfg: RunConfig, engine: RolloutEngine, tokenizer, *, max_prompt_tokens: int | None = None,
                 prompts: PromptSource | None = None):
        """`max_prompt_tokens`: rows whose prompt is longer are skipped and counted at load time
        (the model's positions minus the response budget; None = no limit).  `prompts`: the training
        prompts when they were loaded already (to size the engine's cache from the longest)."""
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.group_size = cfg.grpo.group_size
        self.generator = RolloutGenerator(cfg, engine, tokenizer)
        self.prompts = prompts or PromptSource(cfg, tokenizer, cfg.optim.rollout_batch_size // self.group_size,
                                               max_prompt_tokens=max_prompt_tokens)
        # An engine able to sleep that the memory plan keeps awake after the first steps (sleep_mode auto).
        self.stays_awake = False
        # How many prompts each round of dynamic sampling draws (grpo.oversample), from the rounds seen.
        self.round_size = RoundSizer(cfg.grpo.oversample, self.prompts.per_step)
        self.queue = BatchQueue(cfg.schedule, self.collect, self.position)
        # Asynchronous rollouts: the queue hands out the batches and collects ahead.
        self.next_batch, self.prefetch, self.weights_synced = (
            self.queue.next_batch, self.queue.prefetch, self.queue.weights_synced)
        log.info("sampler: %d training prompts (%s), %d per step, engine %s", len(self.prompts.examples),
                 cfg.data.source, self.prompts.per_step, type(engine).__name__)

    # ------------------------------------------------------------------ the step's batch

    @property
    def sleep_level(self) -> int:
        """How deeply the engine sleeps between steps (an engine that `sleeps`).  When every
        step syncs the policy's weights into it before it generates again (`schedule.sync_every: 1`
        and no batches collected ahead), level 2: its weights are dropped, not copied to host memory
        and back (3-4 GB each way for a 1.5B model), since the sync replaces them all (its checksum
        proves it).  Otherwise level 1, which keeps them."""
        s = self.cfg.schedule
        return 2 if s.sync_every == 1 and s.max_staleness == 0 else 1

    def collect(self, step: int, timed: Timer = untimed) -> tuple[RolloutBatch, dict]:
        """The step's graded batch with its advantages, and what to log about it (timed as the
        phases "sample" and "grade").

        Without dynamic sampling this is one round: the next prompts, `group_size` responses each.
        With `grpo.dynamic_sampling`, rounds of fresh prompts follow until the batch holds its
        number of groups with differing rewards (at most `grpo.max_sampling_rounds` rounds), each
        round drawing as many prompts as `grpo.oversample` asks for the groups still missing
        (`rlft.batching.round_size`); the batch always has the configured size (see
        `rlft.batching.dynamic_sampling`).
        """
        cfg, g = self.cfg, self.cfg.grpo
        rounds = g.max_sampling_rounds if g.dynamic_sampling else 1
        pool = GroupPool(target_groups=self.prompts.per_step)
        epochs_before = self.prompts.epochs_taken
        rollout, grades, examples = Rollout.empty(), [], []
        if getattr(self.engine, "raw_engine_seconds", None):  # an evaluation's since the last step: not this step's
            self.engine.raw_engine_seconds = []
        metrics = dict.fromkeys((f"grader/{k}" for k in GRADER_COUNTERS), 0.0)
        metrics.update(demonstration_step(self.generator.environment, step))  # environment.demonstrations
        for r in range(rounds):
            with timed("sample"):
                missing = self.prompts.per_step - len(pool.kept)  # groups the step still needs
                round_examples = self.prompts.next_examples(self.round_size.prompts_for(missing))
                part = self.generator.generate(round_examples, seed=cfg.seed * 1_000_003 + step + 7919 * r,
                                               keep_awake=r + 1 < rounds, logprobs=self.wants_logprobs(step))
            with timed("grade"):
                part_grades, counts = self.generator.grade(part)
            self.prompts.observe(round_examples, part_grades)
            for k, v in counts.items():
                metrics[k] += v
            rollout, grades, examples = rollout.extend(part), grades + part_grades, examples + round_examples
            informative = informative_groups(torch.tensor([x["reward"] for x in part_grades]), self.group_size)
            pool.add_round(informative)
            if g.dynamic_sampling:
                self.round_size.saw(len(round_examples), int(informative.sum()))
            if pool.full:
                break
        if self.engine.sleeps and not self.stays_awake:
            self.engine.sleep(level=self.sleep_level)  # give the GPU's memory to the policy until the next sync
        raw = getattr(self.engine, "raw_engine_seconds", None)
        if raw:  # benchmarks: the same rollouts through the engine's own generate, interleaved
            metrics["time/sample_raw_engine"] = sum(raw)
            self.engine.raw_engine_seconds = []
        if g.dynamic_sampling:
            metrics.update(pool.stats())
            metrics["dynamic_sampling/keep_rate"] = self.round_size.keep_rate  # the running share sizing rounds
            metrics.update(all_rollouts_metrics(grades))
            chosen = pool.selection()
            rows = group_rows(chosen, self.group_size)
            rollout, grades, examples = rollout.select(rows), [grades[i] for i in rows], [examples[i] for i in chosen]
        with timed("grade"):
            batch, reward_stats = self.to_batch(rollout, grades)
            metrics["epoch_ended"] = self.prompts.epochs_taken > epochs_before
        metrics.update(rollout_metrics(rollout, grades, batch, reward_stats))
        if None not in rollout.episodes:  # a multi-turn environment: turns, tool calls, how episodes ended
            metrics.update(episode_metrics(rollout.episodes, correct=[g["answer_reward"] for g in grades],
                                           answer_format=cfg.reward.answer_format))
        metrics.update(self.filter_overlong(batch, rollout))  # after: lengths describe what was sampled
        metrics.update(mask_void_episodes(cfg.environment.void_turns, batch, rollout.episodes, cfg.reward.answer_format))
        metrics["prompt_indices"] = [ex.index for ex in examples]
        metrics.update(self.prompts.metrics())
        every = cfg.schedule.log_samples_every
        if every and step % every == 0:
            metrics["samples"] = self.samples(examples, rollout, grades)
        return batch, metrics

    def wants_logprobs(self, step: int) -> bool:
        """Whether the rollouts of `step` ask the engine for log-probs: only where something reads them
        (TIS, off-policy batches, the steps that log rollout_mismatch/*; see
        `GRPOConfig.wants_sampler_logprobs`)."""
        return self.cfg.grpo.wants_sampler_logprobs(step, self.cfg.schedule.max_staleness)

    def to_batch(self, rollout: Rollout, grades: list[dict]) -> tuple[RolloutBatch, dict]:
        """Group-normalised advantages and the padded batch the policy trains on (with the sampler's
        log-probs).  With an overlong mode that changes rewards (`grpo.overlong: soft_penalty`) the
        rewards change first, so the advantages and `raw_rewards` include it (the logged reward/* do not)."""
        g, tok = self.cfg.grpo, self.tokenizer
        rewards = torch.tensor([grade["reward"] for grade in grades], dtype=torch.float32)
        if OVERLONG_MODES[g.overlong].changes_rewards:
            rewards = rewards + self.overlong(rollout).reward_change
        advantages, raw_rewards, reward_stats = compute_group_normalized_rewards(
            rewards, g.group_size, g.advantage_eps, g.advantage_estimator)
        # Every token the engine produced is a response token; with `grpo.train_on_eos: false` the eos
        # and bos ids are masked out as in the original.
        special = {} if g.train_on_eos else {"eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id}
        batch = build_rollout_batch(rollout.prompt_ids, rollout.response_ids, pad_token_id=tok.pad_token_id, **special,
                                    padding_side=self.cfg.model.padding_side,
                                    response_logprobs=None if None in rollout.logprobs else rollout.logprobs,
                                    response_token_masks=None if None in rollout.model_masks else rollout.model_masks)
        batch.advantages, batch.raw_rewards = advantages, raw_rewards
        return batch, reward_stats

    def overlong(self, rollout: Rollout) -> OverlongOutcome:
        """What the overlong mode (`grpo.overlong`, `rlft.batching.overlong`) does to these responses (an
        episode's length, tool replies included, against its budget, `environment.max_episode_tokens`)."""
        lengths = torch.tensor([len(ids) for ids in rollout.response_ids])
        budget = self.cfg.sampling.max_tokens
        if None not in rollout.episodes:
            budget = self.cfg.environment.episode_tokens(budget)
        return overlong_outcome(self.cfg.grpo.overlong, lengths, rollout.finish_reasons, budget, self.cfg.grpo)

    def filter_overlong(self, batch: RolloutBatch, rollout: Rollout) -> dict:
        """With an overlong mode that masks rows (`grpo.overlong: filter`: the responses cut by
        max_tokens), zero their response mask (in place); the mode's counts for the log (nothing when
        it is off).  The step's response_length/* and tokens/* (and the throughput read from them)
        keep counting what was sampled."""
        outcome = self.overlong(rollout)
        if OVERLONG_MODES[self.cfg.grpo.overlong].masks_rows:
            batch.response_mask[outcome.masked_rows] = 0.0
        return outcome.metrics

    def samples(self, examples: list[Example], rollout: Rollout, grades: list[dict]) -> list[dict]:
        """A few completions, spread over the batch, for the log (`examples`: one per group)."""
        n = self.cfg.schedule.num_logged_samples
        def response(i: int) -> dict:
            episode = rollout.episodes[i]
            return {"response": rollout.responses[i]} if episode is None else episode_sample(episode)

        return [{"question": examples[i // self.group_size].question, **response(i),
                 "ground_truth": rollout.ground_truths[i], **grades[i]}
                for i in range(0, len(grades), max(1, len(grades) // n))][:n]

    # ------------------------------------------------------------------ checkpoints

    def position(self) -> dict:
        """Where the drawing stands: the prompt order's state and the keep rate that sizes the rounds."""
        return {**self.prompts.state_dict(), ROUND_SIZE: self.round_size.state_dict()}

    def state_dict(self) -> dict:
        """The position to checkpoint (before any batches collected ahead, `BatchQueue.resume_position`)."""
        return self.queue.resume_position()

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state)
        if ROUND_SIZE in state:  # absent from checkpoints of before grpo.oversample
            self.round_size.load_state_dict(state[ROUND_SIZE])


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
