"""The sampler's prompts: the training split, loaded once, and the seeded, resumable order in which
each step draws `optim.rollout_batch_size / grpo.group_size` of them (`data.sampler`,
rlft/data/prompt_samplers.py), or each round of dynamic sampling as many as it asks for."""
from __future__ import annotations

from rlft.batching.round_size import most_prompts_per_round
from rlft.common import log
from rlft.config import ConfigError, RunConfig
from rlft.data import Example
from rlft.data.prompt_samplers import PROMPT_SAMPLERS, checked_batch, checked_metrics, checked_observe, pass_rates
from rlft.data.prompts import drop_long_prompts, prompt_of
from rlft.data.rows import load_split


DRAWN_AHEAD, EPOCH_ENDS = "drawn_ahead", "drawn_ahead_epoch_ends"  # their keys in the checkpoint


class PromptSource:
    """The training rows whose first-turn prompt (the environment's whole opening) fits the model
    (`max_prompt_tokens`: the model's positions minus the episode's budget; longer rows are skipped and
    counted), and their order."""

    def __init__(self, cfg: RunConfig, tokenizer, prompts_per_step: int, *, max_prompt_tokens: int | None = None):
        d = cfg.data
        try:
            loaded = load_split(d, d.train_split, size=d.train_size, seed=cfg.seed)
        except ValueError as e:  # e.g. no usable row at all: one line, as for too few
            raise ConfigError(f"data.source: {e}") from None
        self._lengths: dict[int, int] = {}  # a row's first-turn prompt tokens, once measured
        if max_prompt_tokens is not None:
            self._measure(cfg, tokenizer, loaded.examples)
            loaded = drop_long_prompts(loaded, tokenizer, prompt_of(cfg), max_prompt_tokens,
                                       f"{d.source} [{d.train_split}]",
                                       lengths=[self._lengths[ex.index] for ex in loaded.examples])
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
        self.drawn_ahead: list[int] = []  # positions drawn from the order, not yet taken by a round
        self.epoch_ends: list[int] = []  # where in drawn_ahead an epoch's prompts end (its last + 1)
        self.epochs_taken = 0
        if self.choice.learns_from_rewards:
            note_second_pass(cfg, len(self.examples), prompts_per_step)

    def _measure(self, cfg: RunConfig, tokenizer, examples: list[Example]) -> None:
        """Each row's first-turn prompt as the engine receives it: the training environment's opening
        (its tools' schemas; a demonstration at the first steps, when `environment.demonstrations` anneals)."""
        from rlft.envs.demonstrations import training_environment
        from rlft.envs.rollouts import opening_lengths

        lengths = opening_lengths(training_environment(cfg), examples, tokenizer)
        self._lengths.update((ex.index, n) for ex, n in zip(examples, lengths))

    def longest_prompt(self, tokenizer, cfg: RunConfig) -> int:
        """The most tokens any training prompt has, as the engine receives it on an episode's first turn
        (the environment's whole opening: `rlft.envs.rollouts.opening_lengths`)."""
        missing = [ex for ex in self.examples if ex.index not in self._lengths]
        if missing:
            self._measure(cfg, tokenizer, missing)
        return max(self._lengths[ex.index] for ex in self.examples)

    @property
    def per_step(self) -> int:
        return self.order.batch_size

    def next_examples(self, count: int | None = None) -> list[Example]:
        """The next `count` prompts in the order (default: a step's), as a round of dynamic sampling
        takes them: the order hands out whole batches, and what a round leaves of the last one waits,
        drawn ahead, for the next round (`grpo.oversample`).  `epochs_taken` counts the epochs whose
        last prompt a round has taken."""
        count = self.per_step if count is None else count
        while len(self.drawn_ahead) < count:
            self.drawn_ahead += checked_batch(self.choice.name, self.order.next_batch, len(self.examples))
            if self.order.epoch_done:
                self.epoch_ends.append(len(self.drawn_ahead))
        taken, self.drawn_ahead = self.drawn_ahead[:count], self.drawn_ahead[count:]
        self.epochs_taken += sum(1 for end in self.epoch_ends if end <= count)
        self.epoch_ends = [end - count for end in self.epoch_ends if end > count]
        return [self.examples[i] for i in taken]

    def observe(self, examples: list[Example], grades: list[dict]) -> None:
        """The graded responses to `examples` (one group each, in order): a sampler that learns from
        rewards keeps each prompt's pass rate."""
        if self.choice.learns_from_rewards and examples:
            checked_observe(self.choice.name, self.order.observe, [self._position[ex.index] for ex in examples],
                            pass_rates(grades, len(examples)))

    def metrics(self) -> dict:
        """The order's own numbers for the step's record (`sampler/*`; none for the uniform order)."""
        return checked_metrics(self.choice.name, self.order.metrics) if self.choice.learns_from_rewards else {}

    def state_dict(self) -> dict:
        """The order's state, and the prompts drawn from it that no round has taken yet."""
        return {**self.order.state_dict(), DRAWN_AHEAD: list(self.drawn_ahead), EPOCH_ENDS: list(self.epoch_ends)}

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state)
        # Checkpoints from before grpo.oversample have neither: nothing was drawn ahead.
        self.drawn_ahead = [int(i) for i in state.get(DRAWN_AHEAD, [])]
        self.epoch_ends = [int(i) for i in state.get(EPOCH_ENDS, [])]


def note_second_pass(cfg: RunConfig, num_examples: int, per_step: int) -> bool:
    """An order that learns from rewards (data.sampler: difficulty) rests prompts from its second pass
    over the training prompts: the first draws each once, in a seeded order as the uniform one does.
    One line at start says when that pass begins; a warning where the run's schedule.steps cannot
    reach it even with every round of dynamic sampling drawing a full batch (the order is then
    uniform's in effect).  True when it warned."""
    g = cfg.grpo
    rounds = g.max_sampling_rounds if g.dynamic_sampling else 1
    per_round = most_prompts_per_round(g.oversample, per_step) if g.dynamic_sampling else per_step
    first_pass = max(1, num_examples // per_step) * per_step  # prompts in an epoch (whole batches)
    fewest = -(-first_pass // (rounds * per_round))  # steps before the second pass at the most draws a step
    extra = f" ({fewest} if every step takes all {rounds} rounds of dynamic sampling)" if rounds > 1 else ""
    if cfg.schedule.steps < fewest:
        most = (f"{per_step} a step" if per_round == per_step else f"up to {per_round} a round") + \
            (f" x {rounds} rounds" if rounds > 1 else "")
        log.warning("data.sampler: %s rests prompts from its second pass over the %d training prompts, but this "
                    "run's schedule.steps (%d) draws at most %d prompts (%s): no prompt comes round, so the "
                    "order is the uniform one in effect; lower data.train_size or raise schedule.steps for it to act",
                    cfg.data.sampler, num_examples, cfg.schedule.steps, cfg.schedule.steps * per_round * rounds, most)
        return True
    log.info("data.sampler: %s: the first pass draws the %d training prompts once each; prompts rest from the "
             "second pass, after %d steps%s", cfg.data.sampler, num_examples, first_pass // per_step, extra)
    return False
