"""SFT's data role: (prompt, target) pairs from the train split, handed out in tokenised batches.

Every training row becomes the run's prompt (`rlft.data.prompts.Prompt`; by default the R1-Zero text ending
in `Assistant: <think>`) followed by the target `format_sft_target(solution, prompt)` in the run's answer
format (by default ` reasoning </think> <answer> 72 </answer>`); the policy learns the target tokens only.  The feeder lives on the sampler's rank (SFT has no
sampler) and draws batches in a seeded, resumable order.

Every pair is a rollout row (`rlft.envs.rollouts.RolloutRow`) of the run's environment: the prompt is
its opening (with a multi-turn environment's tools), the target the episode it describes
(`rlft.envs.sft_targets.target_episode`), and the batch is built from the rows' tokens and
`response_mask` as the rollouts' is.  With a multi-turn environment (`environment.name`, e.g.
`calculator`) a target may hold tool calls and the tool's replies (`<tool_response>...</tool_response>`),
tokenised as the chat template's tokens and out of the loss; with `sft.solution_form: tool_calls` GSM8K's
calculator annotations become such calls, answered by the environment's tool (`rlft.envs.traces`).  With
a single-turn one, a row whose target holds a tool's reply is left out (counted as `tool_replies`): the
model would learn to write the tool's answers itself.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from rlft.batching.batch import RolloutBatch, build_rollout_batch
from rlft.common import log
from rlft.config import ConfigError, RunConfig
from rlft.data import PromptSampler
from rlft.data.prompts import DEFAULT_PROMPT_TEMPLATE, Prompt, format_sft_target, prompt_of
from rlft.data.rows import load_split
from rlft.envs.base import Environment, SingleTurnEnvironment
from rlft.envs.registry import make_environment
from rlft.envs.rollouts import RolloutRow
from rlft.envs.sft_targets import TargetError, has_tool_responses, target_episode
from rlft.envs.traces import TraceError, solution_transform

# Reasons a training row is left out (counted and logged once).
SKIP_NO_SOLUTION = "no_solution"  # no worked solution, or one format_sft_target cannot rewrite
SKIP_TOO_LONG = "too_long"  # prompt + target tokens > sft.max_seq_len
SKIP_TOOL_REPLIES = "tool_replies"  # a tool's reply in the target, and no multi-turn environment to mask it
SKIP_BAD_TOOL_TARGET = "bad_tool_target"  # tool replies that cannot be read as an episode (TargetError)


@dataclass
class SFTData:
    """The rows whose prompt + target fit `max_seq_len` (their targets' text beside them), and how many
    were left out, by reason."""

    rows: list[RolloutRow] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def prompts(self) -> list[str]:
        return [row.prompt for row in self.rows]

    @property
    def num_tokens(self) -> list[int]:
        """Prompt + target tokens of each row."""
        return [len(row.prompt_ids) + len(row.response_ids) for row in self.rows]


def build_sft_data(examples, tokenizer, *, template: str | Prompt = DEFAULT_PROMPT_TEMPLATE, max_seq_len: int = 1024,
                   end_with_eos: bool = False, environment: Environment | None = None,
                   transform=None) -> SFTData:
    """Rewrite `rlft.data.Example`s into SFT rows, dropping (and counting) unusable ones.

    The prompt is the environment's opening, tokenised as the engines receive it; the target its
    episode (`target_episode`: tokenised without special tokens, plus the tokenizer's eos with
    `end_with_eos`).  A row is kept when prompt + target tokens <= `max_seq_len`.  `environment`: the
    run's (None: the single-turn one of `template`).  `transform`: `sft.solution_form`'s function of
    (question, ground truth, solution) -> (solution or None, skip reason)
    (`rlft.envs.traces.solution_transform`: annotations as tool calls, or checked).
    """
    prompt = template if isinstance(template, Prompt) else Prompt(template)
    environment = environment if environment is not None else SingleTurnEnvironment(prompt)
    if end_with_eos and tokenizer.eos_token_id is None:
        raise ValueError("end_with_eos: the tokenizer has no eos token to end the targets with")
    skipped: Counter = Counter()
    out = SFTData()
    for ex in examples:
        solution, reason = transform(ex.question, ex.ground_truth, ex.solution) if transform and ex.solution else (
            ex.solution, None)
        if reason is not None:
            skipped[reason] += 1
            continue
        target = format_sft_target(solution, prompt) if solution else None
        if target is None:
            skipped[SKIP_NO_SOLUTION] += 1
            continue
        if not environment.multi_turn and has_tool_responses(target):
            skipped[SKIP_TOOL_REPLIES] += 1
            continue
        start = environment.open(ex.question, ex.ground_truth)
        prompt_ids = start.token_ids(tokenizer)
        try:
            episode = target_episode(tokenizer, start, target,
                                     eos_token_id=tokenizer.eos_token_id if end_with_eos else None)
        except TargetError:
            skipped[SKIP_BAD_TOOL_TARGET] += 1
            continue
        if len(prompt_ids) + len(episode.token_ids) > max_seq_len:
            skipped[SKIP_TOO_LONG] += 1
            continue
        out.rows.append(RolloutRow(ex, start.render(tokenizer), prompt_ids, episode))
        out.targets.append(target)
    out.skipped = dict(skipped)
    return out


def sft_batch(data: SFTData, indices: list[int], tokenizer, padding_side: str = "right", *,
              end_with_eos: bool = False) -> RolloutBatch:
    """The training batch of the rows at `indices`: its `response_mask` (label-aligned: column t is 1
    when token t+1 is a target token) selects the target tokens the loss reads, the eos that ends each
    target included with `end_with_eos` (other eos and bos ids left out); an episode's tool replies
    stay out of it."""
    rows = [data.rows[i] for i in indices]
    special = {} if end_with_eos else {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("tokenizer has neither a pad token nor an eos token to pad with")
    return build_rollout_batch([row.prompt_ids for row in rows], [row.response_ids for row in rows], pad_token_id=pad,
                               **special, padding_side=padding_side, response_mask=[row.response_mask for row in rows])


def sft_total_steps(num_examples: int, batch_size: int, epochs: int, max_steps: int | None) -> int:
    """`max_steps` when set, else `epochs` x whole batches per epoch (a short last batch is dropped,
    as `PromptSampler` does; each epoch reshuffles, so every example is still seen over epochs)."""
    if num_examples < batch_size:
        raise ConfigError(f"sft.batch_size: {batch_size} sequences per step but only {num_examples} usable "
                          f"training examples; lower sft.batch_size, or raise sft.train_size / sft.max_seq_len")
    return max_steps if max_steps is not None else epochs * (num_examples // batch_size)


class SFTFeeder:
    """Loads the train split (`sft.train_size` rows), keeps the pairs that fit `sft.max_seq_len` (and
    the model's `context` positions) and hands out `sft.batch_size` of them per step;
    `total_steps` is what the data allow (`sft.max_steps`, or `sft.epochs` x whole batches)."""

    def __init__(self, cfg: RunConfig, tokenizer, *, context: int | None = None):
        self.cfg, self.tokenizer = cfg, tokenizer
        try:
            loaded = load_split(cfg.data, cfg.data.train_split, size=cfg.sft.train_size, seed=cfg.seed)
        except ValueError as e:  # e.g. no usable row at all
            raise ConfigError(f"data.source: {e}") from None
        max_seq_len = min(cfg.sft.max_seq_len, context or cfg.sft.max_seq_len)
        e = cfg.environment
        environment = make_environment(e.name, prompt_of(cfg), e.options, tools=e.tools)
        try:  # tool calls need a multi-turn environment to write and answer them
            transform = solution_transform(cfg.sft.solution_form, environment if environment.multi_turn else None,
                                           e.max_turns)
        except TraceError as err:
            raise ConfigError(str(err)) from None
        data = build_sft_data(loaded.examples, tokenizer, template=prompt_of(cfg), max_seq_len=max_seq_len,
                              end_with_eos=cfg.sft.end_with_eos, environment=environment, transform=transform)
        data.skipped = dict(Counter(loaded.skipped) + Counter(data.skipped))
        if not len(data):
            reasons = ", ".join(f"{k}={v}" for k, v in sorted(data.skipped.items()))
            limit = (f"sft.max_seq_len={cfg.sft.max_seq_len}" if max_seq_len == cfg.sft.max_seq_len
                     else f"the model's {max_seq_len} positions")
            raise ConfigError(f"data.source: no usable SFT example in {cfg.data.source} [{cfg.data.train_split}] "
                              f"(skipped: {reasons}; too_long = prompt + target over {limit}); rows need a worked "
                              f"solution ending in '#### <number>' that fits")
        self.data = data
        self.total_steps = sft_total_steps(len(data), cfg.sft.batch_size, cfg.sft.epochs, cfg.sft.max_steps)
        self.prompts = PromptSampler(len(data), cfg.sft.batch_size, cfg.seed, shuffle=cfg.data.shuffle)
        mean_len = sum(data.num_tokens) / len(data)
        log.info("sft data: %d pairs from %s [%s] (mean %.0f tokens; skipped %s), %d per step, %d steps per "
                 "epoch, %d steps", len(data), cfg.data.source, cfg.data.train_split, mean_len,
                 ", ".join(f"{k}={v}" for k, v in sorted(data.skipped.items())) or "none", cfg.sft.batch_size,
                 self.prompts.batches_per_epoch, self.total_steps)

    def info(self) -> dict:
        """What every rank needs to know of the data: the step count and what was kept/skipped."""
        return {"total_steps": self.total_steps, "num_examples": len(self.data), "skipped": self.data.skipped}

    def next_batch(self) -> RolloutBatch:
        return sft_batch(self.data, self.prompts.next_batch(), self.tokenizer, self.cfg.model.padding_side,
                         end_with_eos=self.cfg.sft.end_with_eos)

    def batch_metrics(self, batch: RolloutBatch) -> dict:
        return {"tokens/total": float(batch.attention_mask.sum()),
                "tokens/response": float(batch.response_mask.sum()),
                "sequence_length/max": float(batch.attention_mask.sum(-1).max()),
                "data/epoch": self.prompts.progress}

    def state_dict(self) -> dict:
        return self.prompts.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state)
