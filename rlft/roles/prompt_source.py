"""The sampler's prompts: the training split, loaded once, and the seeded, resumable order in which
each step draws `optim.rollout_batch_size / grpo.group_size` of them (`data.sampler`,
rlft/data/prompt_samplers.py)."""
from __future__ import annotations

from rlft.common import log
from rlft.config import ConfigError, RunConfig
from rlft.data import Example
from rlft.data.prompt_samplers import PROMPT_SAMPLERS, pass_rates
from rlft.data.prompts import drop_long_prompts, prompt_of
from rlft.data.rows import load_split


class PromptSource:
    """The training rows whose prompt fits the model (`max_prompt_tokens`: the model's positions
    minus the response budget; longer rows are skipped and counted), and their order."""

    def __init__(self, cfg: RunConfig, tokenizer, prompts_per_step: int, *, max_prompt_tokens: int | None = None):
        d = cfg.data
        try:
            loaded = load_split(d, d.train_split, size=d.train_size, seed=cfg.seed)
        except ValueError as e:  # e.g. no usable row at all: one line, as for too few
            raise ConfigError(f"data.source: {e}") from None
        loaded = drop_long_prompts(loaded, tokenizer, prompt_of(cfg), max_prompt_tokens,
                                   f"{d.source} [{d.train_split}]")
        self.examples, self.skipped = loaded.examples, loaded.skipped
        if len(self.examples) < prompts_per_step:
            skipped = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items()))
            raise ConfigError(
                f"data.train_size: {len(self.examples)} usable training rows in {d.source} [{d.train_split}]"
                f"{f' (skipped: {skipped})' if skipped else ''}, but every step draws optim.rollout_batch_size / "
                f"grpo.group_size = {prompts_per_step} prompts; raise data.train_size or lower "
                f"optim.rollout_batch_size")
        self.choice = PROMPT_SAMPLERS[d.sampler]
        self.order = self.choice.build(len(self.examples), prompts_per_step, cfg.seed, d)
        self._position = {ex.index: p for p, ex in enumerate(self.examples)}
        if self.choice.learns_from_rewards:
            note_second_pass(cfg, len(self.examples), prompts_per_step)

    def longest_prompt(self, tokenizer, cfg: RunConfig, chunk_size: int = 1024) -> int:
        """The most tokens any training prompt has, as the engine receives it."""
        prompt, longest = prompt_of(cfg), 0
        for lo in range(0, len(self.examples), chunk_size):
            ids = prompt.encode([ex.question for ex in self.examples[lo:lo + chunk_size]], tokenizer)
            longest = max(longest, *(len(p) for p in ids))
        return longest

    @property
    def per_step(self) -> int:
        return self.order.batch_size

    @property
    def epoch_done(self) -> bool:
        return self.order.epoch_done

    def next_examples(self) -> list[Example]:
        """The next step's (or round's) prompts, in the order drawn."""
        return [self.examples[i] for i in self.order.next_batch()]

    def observe(self, examples: list[Example], grades: list[dict]) -> None:
        """The graded responses to `examples` (one group each, in order): a sampler that learns from
        rewards keeps each prompt's pass rate."""
        if self.choice.learns_from_rewards and examples:
            self.order.observe([self._position[ex.index] for ex in examples], pass_rates(grades, len(examples)))

    def metrics(self) -> dict:
        """The order's own numbers for the step's record (`sampler/*`; none for the uniform order)."""
        return self.order.metrics() if self.choice.learns_from_rewards else {}

    def state_dict(self) -> dict:
        return self.order.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state)


def note_second_pass(cfg: RunConfig, num_examples: int, per_step: int) -> bool:
    """An order that learns from rewards (data.sampler: difficulty) rests prompts from its second pass
    over the training prompts: the first draws each once, in a seeded order as the uniform one does.
    One line at start says when that pass begins; a warning where the run's schedule.steps cannot
    reach it even with every round of dynamic sampling drawing a full batch (the order is then
    uniform's in effect).  True when it warned."""
    g = cfg.grpo
    rounds = g.max_sampling_rounds if g.dynamic_sampling else 1
    first_pass = max(1, num_examples // per_step)  # batches in an epoch (they never span two)
    fewest = -(-first_pass // rounds)  # steps before the second pass at the most draws a step
    extra = f" ({fewest} if every step takes all {rounds} rounds of dynamic sampling)" if rounds > 1 else ""
    if cfg.schedule.steps < fewest:
        log.warning("data.sampler: %s rests prompts from its second pass over the %d training prompts, but this "
                    "run's schedule.steps (%d) draws at most %d prompts (%d a step%s): no prompt comes round, so the "
                    "order is the uniform one in effect; lower data.train_size or raise schedule.steps for it to act",
                    cfg.data.sampler, num_examples, cfg.schedule.steps, cfg.schedule.steps * per_step * rounds,
                    per_step, f" x {rounds} rounds" if rounds > 1 else "")
        return True
    log.info("data.sampler: %s: the first pass draws the %d training prompts once each; prompts rest from the "
             "second pass, after %d steps%s", cfg.data.sampler, num_examples, first_pass, extra)
    return False
