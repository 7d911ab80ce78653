"""SFT's data role: (prompt, target) pairs from the train split, handed out in tokenised batches.

Every training row becomes the run's prompt (`rlft.data.prompts.Prompt`; by default the R1-Zero text ending
in `Assistant: <think>`) followed by the target `format_sft_target(solution, prompt)` in the run's answer
format (by default ` reasoning </think> <answer> 72 </answer>`); the policy learns the target tokens only.  The feeder lives on the sampler's rank (SFT has no
sampler) and draws batches in a seeded, resumable order.

With a multi-turn environment (`environment.name`, e.g. `calculator`) the prompt is the environment's
opening (with its tools) and a target may hold tool calls and the tool's replies
(`<tool_response>...</tool_response>`): it is tokenised as the episode it describes
(`rlft.envs.sft_targets`), the replies as the chat template's tokens and out of the loss; with
`sft.solution_form: tool_calls` GSM8K's calculator annotations become such calls, answered by the
environment's tool (`rlft.envs.traces`).  Without one,
a row whose target holds a tool's reply is left out (counted as `tool_replies`): the model would learn
to write the tool's answers itself.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from rlft.batching.batch import RolloutBatch, build_rollout_batch, tokenize_prompt_and_output
from rlft.common import log
from rlft.config import ConfigError, RunConfig
from rlft.data import PromptSampler
from rlft.data.prompts import DEFAULT_PROMPT_TEMPLATE, Prompt, format_sft_target, prompt_of
from rlft.data.rows import load_split
from rlft.envs.registry import environment_record, make_environment
from rlft.envs.sft_targets import TargetError, has_tool_responses, target_token_ids
from rlft.envs.traces import TraceError, solution_transform

# Reasons a training row is left out (counted and logged once).
SKIP_NO_SOLUTION = "no_solution"  # no worked solution, or one format_sft_target cannot rewrite
SKIP_TOO_LONG = "too_long"  # prompt + target tokens > sft.max_seq_len
SKIP_TOOL_REPLIES = "tool_replies"  # a tool's reply in the target, and no multi-turn environment to mask it
SKIP_BAD_TOOL_TARGET = "bad_tool_target"  # tool replies that cannot be read as an episode (TargetError)


@dataclass
class SFTData:
    """Prompt/target text pairs that fit `max_seq_len`, and how many rows were left out, by reason."""

    prompts: list[str]
    targets: list[str]
    num_tokens: list[int]  # prompt + target tokens of each pair
    skipped: dict[str, int] = field(default_factory=dict)
    # With a multi-turn environment: each pair's (prompt ids, target ids, target mask: 0 on tool replies)
    token_rows: list[tuple[list[int], list[int], list[int]]] | None = None

    def __len__(self) -> int:
        return len(self.prompts)


def build_sft_data(examples, tokenizer, *, template: str | Prompt = DEFAULT_PROMPT_TEMPLATE, max_seq_len: int = 1024,
                   chunk_size: int = 1024, end_with_eos: bool = False, environment=None,
                   transform=None) -> SFTData:
    """Rewrite `rlft.data.Example`s into SFT pairs, dropping (and counting) unusable ones.

    Token counts are those `rlft.batching.batch.tokenize_prompt_and_output` will produce: the prompt
    tokenised with the tokenizer's special tokens (only what its attention mask keeps), the target
    without, plus its eos with `end_with_eos`.  A pair is kept when prompt + target tokens <= `max_seq_len`.
    `environment`: a multi-turn environment, whose episodes the pairs are (`episode_rows`).
    `transform`: `sft.solution_form`'s function of (question, ground truth, solution) -> (solution or
    None, skip reason) (`rlft.envs.traces.solution_transform`: annotations as tool calls, or checked).
    """
    prompt = template if isinstance(template, Prompt) else Prompt(template)
    skipped: Counter = Counter()
    pairs = []
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
        if environment is None and has_tool_responses(target):
            skipped[SKIP_TOOL_REPLIES] += 1
            continue
        pairs.append((ex, target) if environment is not None else (prompt.render(ex.question, tokenizer), target))
    if environment is not None:
        return episode_rows(pairs, tokenizer, environment, max_seq_len, end_with_eos, skipped)
    out = SFTData([], [], [], {})
    for lo in range(0, len(pairs), chunk_size):  # batched: the fast tokenizers' parallel path
        prompts, targets = zip(*pairs[lo:lo + chunk_size])
        p_enc = tokenizer(list(prompts))
        t_enc = tokenizer(list(targets), add_special_tokens=False)
        for prompt, target, mask, t_ids in zip(prompts, targets, p_enc["attention_mask"], t_enc["input_ids"]):
            n = int(sum(mask)) + len(t_ids) + int(end_with_eos)
            if n > max_seq_len:
                skipped[SKIP_TOO_LONG] += 1
                continue
            out.prompts.append(prompt)
            out.targets.append(target)
            out.num_tokens.append(n)
    out.skipped = dict(skipped)
    return out


def episode_rows(pairs: list, tokenizer, environment, max_seq_len: int, end_with_eos: bool,
                 skipped: Counter) -> SFTData:
    """SFT pairs as episodes of `environment`: `pairs` of (example, target), the prompt the environment's
    opening and the target tokenised by `rlft.envs.sft_targets.target_token_ids` (the eos ending the
    last turn added with `end_with_eos`)."""
    out = SFTData([], [], [], {}, token_rows=[])
    for ex, target in pairs:
        start = environment.open(ex.question, ex.ground_truth)
        prompt_ids = start.token_ids(tokenizer)
        try:
            ids, mask = target_token_ids(tokenizer, start, target)
        except TargetError:
            skipped[SKIP_BAD_TOOL_TARGET] += 1
            continue
        if end_with_eos:
            ids, mask = ids + [tokenizer.eos_token_id], mask + [1]
        if len(prompt_ids) + len(ids) > max_seq_len:
            skipped[SKIP_TOO_LONG] += 1
            continue
        out.prompts.append(start.render(tokenizer))
        out.targets.append(target)
        out.num_tokens.append(len(prompt_ids) + len(ids))
        out.token_rows.append((prompt_ids, ids, mask))
    out.skipped = dict(skipped)
    return out


def sft_batch(data: SFTData, indices: list[int], tokenizer, padding_side: str = "right", *,
              end_with_eos: bool = False) -> RolloutBatch:
    """The training batch of the pairs at `indices`: its `response_mask` (label-aligned: column t
    is 1 when token t+1 is a target token) selects the target tokens the loss reads, the eos that
    ends each target included with `end_with_eos`; an episode's tool replies stay out of it."""
    if data.token_rows is not None:
        rows = [data.token_rows[i] for i in indices]
        special = ({} if end_with_eos
                   else {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id})
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return build_rollout_batch([r[0] for r in rows], [r[1] for r in rows], pad_token_id=pad, **special,
                                   padding_side=padding_side, response_token_masks=[r[2] for r in rows])
    return tokenize_prompt_and_output([data.prompts[i] for i in indices], [data.targets[i] for i in indices],
                                      tokenizer, padding_side=padding_side, append_eos=end_with_eos)


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
        environment = (make_environment(e.name, prompt_of(cfg), e.options)
                       if environment_record(e.name).multi_turn else None)
        try:
            transform = solution_transform(cfg.sft.solution_form, environment, e.max_turns)
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
