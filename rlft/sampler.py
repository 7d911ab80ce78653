"""The sampler role: prompts -> grouped rollouts (token ids) from a rollout engine.

Prompts are tokenised once here; the engine returns response token ids, so the trainer never
re-tokenises model text.  Responses are laid out group-major: the `group_size` responses to
prompt i sit at rows [i * group_size, (i + 1) * group_size).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from rlft.config import SamplingConfig
from rlft.data import Example
from rlft.engines.base import RolloutEngine, SamplingSpec
from rlft.prompts import format_prompt


@dataclass
class Rollout:
    example_indices: list[int]  # per response
    prompt_ids: list[list[int]]  # per response (repeated within a group)
    response_ids: list[list[int]]
    responses: list[str]
    ground_truths: list[str]
    finish_reasons: list[str]
    prompts: list[str]  # per response

    @classmethod
    def empty(cls) -> "Rollout":
        return cls([], [], [], [], [], [], [])

    def extend(self, other: "Rollout") -> "Rollout":
        """This rollout's rows followed by `other`'s."""
        return Rollout(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def select(self, rows: list[int]) -> "Rollout":
        """The given rows, in that order."""
        return Rollout(*([getattr(self, f.name)[i] for i in rows] for f in fields(self)))


def sampling_spec(cfg: SamplingConfig, *, n: int, seed: int | None, evaluation: bool = False) -> SamplingSpec:
    """The engine's sampling parameters from the config (evaluation: greedy by default)."""
    return SamplingSpec(
        temperature=cfg.eval_temperature if evaluation else cfg.temperature,
        top_p=1.0 if evaluation and cfg.eval_temperature == 0 else cfg.top_p,
        min_tokens=cfg.min_tokens,
        max_tokens=(cfg.eval_max_tokens or cfg.max_tokens) if evaluation else cfg.max_tokens,
        stop=list(cfg.stop), include_stop_str_in_output=cfg.include_stop_str_in_output,
        repetition_penalty=cfg.repetition_penalty, n=n, seed=seed)


class Sampler:
    def __init__(self, engine: RolloutEngine, tokenizer, sampling: SamplingConfig, prompt_template: str):
        self.engine, self.tokenizer = engine, tokenizer
        self.sampling, self.prompt_template = sampling, prompt_template

    def tokenize_prompts(self, examples: list[Example]) -> tuple[list[str], list[list[int]]]:
        prompts = [format_prompt(ex.question, self.prompt_template) for ex in examples]
        return prompts, [list(ids) for ids in self.tokenizer(prompts)["input_ids"]]

    def rollout(self, examples: list[Example], group_size: int, seed: int) -> Rollout:
        prompts, prompt_ids = self.tokenize_prompts(examples)
        groups = self.engine.generate(prompt_ids, sampling_spec(self.sampling, n=group_size, seed=seed))
        out = Rollout.empty()
        for ex, text, ids, group in zip(examples, prompts, prompt_ids, groups):
            if len(group) != group_size:
                raise RuntimeError(f"rollout engine returned {len(group)} completions for a prompt, "
                                   f"expected {group_size}")
            for c in group:
                out.example_indices.append(ex.index)
                out.prompt_ids.append(ids)
                out.response_ids.append(list(c.token_ids))
                out.responses.append(c.text)
                out.ground_truths.append(ex.ground_truth)
                out.finish_reasons.append(c.finish_reason)
                out.prompts.append(text)
        return out
