"""The sampler's prompts: the training split, loaded once, and the seeded, resumable order in which
each step draws `optim.rollout_batch_size / grpo.group_size` of them."""
from __future__ import annotations

from rlft.config import ConfigError, RunConfig
from rlft.data import Example, PromptSampler, load_examples
from rlft.prompts import drop_long_prompts, prompt_of


class PromptSource:
    """The training rows whose prompt fits the model (`max_prompt_tokens`: the model's positions
    minus the response budget; longer rows are skipped and counted), and their order."""

    def __init__(self, cfg: RunConfig, tokenizer, prompts_per_step: int, *, max_prompt_tokens: int | None = None):
        d = cfg.data
        try:
            loaded = load_examples(d.source, d.train_split, size=d.train_size, seed=cfg.seed)
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
        self.order = PromptSampler(len(self.examples), prompts_per_step, cfg.seed, shuffle=d.shuffle)

    @property
    def per_step(self) -> int:
        return self.order.batch_size

    @property
    def epoch_done(self) -> bool:
        return self.order.epoch_done

    def next_examples(self) -> list[Example]:
        """The next step's (or round's) prompts, in the order drawn."""
        return [self.examples[i] for i in self.order.next_batch()]

    def state_dict(self) -> dict:
        return self.order.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state)
