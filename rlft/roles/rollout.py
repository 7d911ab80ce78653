"""The rollout role (the sampler): each step's batch, from prompts to advantages.

Its parts, one job each: `PromptSource` (rlft.roles.prompt_source) draws the prompts,
`RolloutGenerator` (rlft.roles.generation) plays and grades the episodes (one engine call per turn;
a single-turn rollout is one call with n = group_size), `BatchQueue` (rlft.roles.batch_queue) holds
batches collected ahead for asynchronous rollouts.  Here, `RolloutWorker.collect` is the one place the
step's training data comes from, in order: `sample_rounds` (rounds of dynamic sampling, each sized by
`RoundSizer`, its grades fed back to the difficulty sampler), `rest_engine` (the engine sleeps), the
kept groups (`Drawn.kept`), `to_batch` (overlong rewards, group advantages, the padded batch) and
`step_metrics` (what is logged about it).  `train_grpo.grpo_step` calls `next_batch` / `prefetch` /
`weights_synced`, which hand over to the queue, whose `collect` is this worker's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlft.batching.batch import RolloutBatch, build_rollout_batch
from rlft.common import LENGTH, log
from rlft.config import RunConfig
from rlft.data import Example
from rlft.batching.dynamic_sampling import GroupPool, group_rows, informative_groups
from rlft.batching.round_size import RoundSizer
from rlft.engines.base import RolloutEngine
from rlft.envs.demonstrations import demonstration_step
from rlft.envs.metrics import episode_metrics, episode_sample
from rlft.envs.registry import environment_record
from rlft.envs.rollout_options import mask_void_episodes
from rlft.envs.rollouts import episode_budget
from rlft.grpo import OVERLONG_MODES, compute_group_normalized_rewards
from rlft.batching.overlong import OverlongOutcome, overlong_outcome
from rlft.roles.batch_queue import BatchQueue, Timer, untimed
from rlft.roles.generation import GRADER_COUNTERS, Rollout, RolloutGenerator
from rlft.roles.prompt_source import PromptSource


ROUND_SIZE = "round_size"  # the key of the rounds' keep rate in the checkpoint's prompt position


@dataclass
class Drawn:
    """What a step's rounds of sampling drew: every row (group-major), its grade, the examples (one per
    group), the pool of groups with differing rewards, and the grader's counts summed over the rounds."""

    pool: GroupPool
    rollout: Rollout = field(default_factory=list)
    grades: list[dict] = field(default_factory=list)
    examples: list[Example] = field(default_factory=list)
    counts: dict = field(default_factory=lambda: dict.fromkeys((f"grader/{k}" for k in GRADER_COUNTERS), 0.0))

    def add(self, examples: list[Example], rollout: Rollout, grades: list[dict], counts: dict) -> None:
        self.rollout, self.grades, self.examples = self.rollout + rollout, self.grades + grades, self.examples + examples
        for k, v in counts.items():
            self.counts[k] += v

    def kept(self, group_size: int) -> "Drawn":
        """The groups dynamic sampling keeps (`GroupPool.selection`), in the pool's order."""
        chosen = self.pool.selection()
        rows = group_rows(chosen, group_size)
        return Drawn(self.pool, [self.rollout[i] for i in rows], [self.grades[i] for i in rows],
                     [self.examples[i] for i in chosen], self.counts)


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
        # Asynchronous rollouts: batches collected ahead (none unless schedule.max_staleness > 0).
        self.queue = BatchQueue(cfg.schedule, self.collect, self.position)
        log.info("sampler: %d training prompts (%s), %d per step, engine %s", len(self.prompts.examples),
                 cfg.data.source, self.prompts.per_step, type(engine).__name__)

    # ------------------------------------------------------------------ what the step calls

    def next_batch(self, step: int, timed: Timer = untimed) -> tuple[RolloutBatch, dict]:
        """The batch `step` trains on and its metrics: one collected ahead, or `collect(step)` now
        (`BatchQueue.next_batch`)."""
        return self.queue.next_batch(step, timed)

    def prefetch(self, step: int, last_step: int, timed: Timer = untimed) -> None:
        """Collect the batches of the next steps ahead, up to `schedule.max_staleness` (`BatchQueue.prefetch`)."""
        self.queue.prefetch(step, last_step, timed)

    def weights_synced(self, step: int) -> None:
        """The engine now holds the policy's weights after `step`."""
        self.queue.weights_synced(step)

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
        phases "sample" and "grade"): the rounds of sampling, the engine put to rest, the groups
        kept (with `grpo.dynamic_sampling`), the batch and its metrics."""
        self.raw_engine_metrics()  # an evaluation's engine seconds since the last step: not this step's
        epochs_before = self.prompts.epochs_taken
        demonstrations = demonstration_step(self.generator.environment, step)  # environment.demonstrations
        drawn = self.sample_rounds(step, timed)
        self.rest_engine()
        metrics = {**drawn.counts, **self.raw_engine_metrics(), **demonstrations}
        if self.cfg.grpo.dynamic_sampling:
            metrics.update(drawn.pool.stats())
            metrics["dynamic_sampling/keep_rate"] = self.round_size.keep_rate  # the running share sizing rounds
            metrics.update(all_rollouts_metrics(drawn.grades))
            drawn = drawn.kept(self.group_size)
        with timed("grade"):
            batch, reward_stats = self.to_batch(drawn.rollout, drawn.grades)
            metrics["epoch_ended"] = self.prompts.epochs_taken > epochs_before
        metrics.update(self.step_metrics(step, drawn, batch, reward_stats))
        return batch, metrics

    def sample_rounds(self, step: int, timed: Timer = untimed) -> Drawn:
        """The step's rounds of sampling.  Without dynamic sampling, one round: the next prompts,
        `group_size` responses each.  With `grpo.dynamic_sampling`, rounds of fresh prompts follow until
        the pool holds the step's number of groups with differing rewards (at most
        `grpo.max_sampling_rounds` rounds), each drawing as many prompts as `grpo.oversample` asks for the
        groups still missing (`rlft.batching.round_size`, fed each round's keep rate)."""
        g = self.cfg.grpo
        rounds = g.max_sampling_rounds if g.dynamic_sampling else 1
        drawn = Drawn(GroupPool(target_groups=self.prompts.per_step))
        for r in range(rounds):
            examples, part, grades, counts = self.sample_round(step, r, rounds, len(drawn.pool.kept), timed)
            drawn.add(examples, part, grades, counts)
            informative = informative_groups(torch.tensor([x["reward"] for x in grades]), self.group_size)
            drawn.pool.add_round(informative)
            if g.dynamic_sampling:
                self.round_size.saw(len(examples), int(informative.sum()))
            if drawn.pool.full:
                break
        return drawn

    def sample_round(self, step: int, r: int, rounds: int, kept: int,
                     timed: Timer = untimed) -> tuple[list[Example], Rollout, list[dict], dict]:
        """Round `r` of `step` (`kept` groups so far): its prompts, rows, grades and the grader's counts;
        the grades go back to the prompt order (`data.sampler: difficulty` learns pass rates from them)."""
        with timed("sample"):
            missing = self.prompts.per_step - kept  # groups the step still needs
            examples = self.prompts.next_examples(self.round_size.prompts_for(missing))
            part = self.generator.generate(examples, seed=self.cfg.seed * 1_000_003 + step + 7919 * r,
                                           keep_awake=r + 1 < rounds, logprobs=self.wants_logprobs(step))
        with timed("grade"):
            grades, counts = self.generator.grade(part)
        self.prompts.observe(examples, grades)
        return examples, part, grades, counts

    def rest_engine(self) -> None:
        """Give the GPU's memory to the policy until the next sync: an engine that sleeps does, unless
        the memory plan keeps it awake."""
        if self.engine.sleeps and not self.stays_awake:
            self.engine.sleep(level=self.sleep_level)

    def raw_engine_metrics(self) -> dict:
        """Benchmarks (`rlft.bench --raw-engine`): the seconds the engine's own generate took on the same
        rollouts since the last call, as `time/sample_raw_engine` (nothing without them); the record
        is emptied."""
        raw = getattr(self.engine, "raw_engine_seconds", None)
        if not raw:
            return {}
        self.engine.raw_engine_seconds = []
        return {"time/sample_raw_engine": sum(raw)}

    def step_metrics(self, step: int, drawn: Drawn, batch: RolloutBatch, reward_stats: dict) -> dict:
        """What is logged about the step's batch: rewards and lengths, the episodes' turns and tool
        calls (a multi-turn environment's), the overlong mode's counts (its masking applied to `batch`
        here), the prompts drawn and, every `schedule.log_samples_every` steps, a few samples."""
        rollout, grades = drawn.rollout, drawn.grades
        metrics = rollout_metrics(rollout, grades, batch, reward_stats)
        if self.generator.multi_turn:  # turns, tool calls, how episodes ended
            metrics.update(episode_metrics([row.episode for row in rollout], correct=[g["answer_reward"] for g in grades],
                                           answer_format=self.cfg.reward.answer_format))
        metrics.update(self.filter_overlong(batch, rollout))  # after: lengths describe what was sampled
        metrics.update(mask_void_episodes(self.cfg.environment.void_turns, batch, [row.episode for row in rollout],
                                          self.cfg.reward.answer_format))
        metrics["prompt_indices"] = [ex.index for ex in drawn.examples]
        metrics.update(self.prompts.metrics())
        every = self.cfg.schedule.log_samples_every
        if every and step % every == 0:
            metrics["samples"] = self.samples(drawn.examples, rollout, grades)
        return metrics

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
        # The sampler's log-probs, where the step asked the engine for them (`wants_logprobs`).
        logprobs = [row.logprobs for row in rollout]
        batch = build_rollout_batch([row.prompt_ids for row in rollout], [row.response_ids for row in rollout],
                                    pad_token_id=tok.pad_token_id, **special, padding_side=self.cfg.model.padding_side,
                                    response_logprobs=logprobs if all(lp is not None for lp in logprobs) else None,
                                    response_mask=[row.response_mask for row in rollout])
        batch.advantages, batch.raw_rewards = advantages, raw_rewards
        return batch, reward_stats

    def overlong(self, rollout: Rollout) -> OverlongOutcome:
        """What the overlong mode (`grpo.overlong`, `rlft.batching.overlong`) does to these responses (an
        episode's length, tool replies included, against its budget, `environment.max_episode_tokens`)."""
        lengths = torch.tensor([len(row.response_ids) for row in rollout])
        e = self.cfg.environment
        budget = episode_budget(environment_record(e.name).multi_turn, self.cfg.sampling.max_tokens, e.max_episode_tokens)
        return overlong_outcome(self.cfg.grpo.overlong, lengths, [row.finish_reason for row in rollout], budget,
                                self.cfg.grpo)

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
        def response(i: int) -> dict:  # a multi-turn environment's: the episode's transcript and counts
            row = rollout[i]
            return episode_sample(row.episode, self.tokenizer) if self.generator.multi_turn else {"response": row.text}

        return [{"question": examples[i // self.group_size].question, **response(i),
                 "ground_truth": rollout[i].example.ground_truth, **grades[i]}
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
    """The step's rewards, lengths and token counts, over the batch's rows (groups that dynamic sampling
    dropped are not among them).  ``tokens/response`` counts the tokens the loss reads (the model's own, eos
    and bos out unless ``grpo.train_on_eos``); ``tokens/generated`` every token the engine sampled for the
    rows, ``tokens/inserted`` the environment's replies (and their template tokens) between turns,
    ``tokens/prompt`` the prompts as the engine received them: a tool step's cost per generated token
    reads ``time/step / tokens/generated``."""
    resp_len = batch.response_mask.sum(-1).float()
    n = max(1, len(grades))
    generated = sum(sum(row.response_mask) for row in rollout)
    out = {
        "reward/mean": sum(g["reward"] for g in grades) / n,
        "reward/format": sum(g["format_reward"] for g in grades) / n,
        "reward/answer": sum(g["answer_reward"] for g in grades) / n,
        "response_length/mean": float(resp_len.mean()),
        "response_length/max": float(resp_len.max()),
        "response_length/clipped_fraction": sum(row.finish_reason == LENGTH for row in rollout) / n,
        "tokens/response": float(batch.response_mask.sum()),
        "tokens/total": float(batch.attention_mask.sum()),
        "tokens/prompt": float(batch.prompt_lengths.sum()),
        "tokens/generated": float(generated),
        "tokens/inserted": float(sum(len(row.response_ids) for row in rollout) - generated),
    }
    for k, v in reward_stats.items():
        if isinstance(v, (int, float)) or (torch.is_tensor(v) and v.numel() == 1):
            out[f"batch/{k}"] = float(v)
    return out
