"""What an episode asks of the model's positions: its first-turn prompt and its budget after it.

* :func:`episode_budget_of`: the tokens after the prompt an episode may hold, and the key that sets
  them: ``sampling.max_tokens`` (``sampling.eval_max_tokens`` for an evaluation) for one turn, a
  multi-turn environment's ``environment.max_episode_tokens`` (tool replies included) where set;
  the ranks' prompt limit (:func:`rlft.runtime.build.prompt_limit`) is the model's positions minus it.
* :func:`check_first_turn_fits`: refused before any rank starts, with one line naming the numbers,
  when no question can fit: the environment's opening alone (the system prompt, the tools' schemas
  the chat template writes, the demonstration of ``environment.demonstrations: annealed``), rendered
  and tokenised as the episode driver does for turn 1, plus the budget, exceeds the model's positions.

Nothing here imports torch where the opening's text surely fits (its bytes bound its tokens); near the
limit the model's tokenizer is loaded, as the ranks load it, for the exact count.
"""
from __future__ import annotations

import json
from pathlib import Path

from rlft.config.schema import ConfigError, RunConfig


def episode_budget_of(cfg: RunConfig, *, evaluation: bool = False) -> tuple[int, str]:
    """(tokens after the prompt an episode may hold, the key that sets them), as the episodes of
    training (or with ``evaluation``, of the evaluator: one turn unless ``environment.evaluate_with_tools``)
    are played (:func:`rlft.envs.rollouts.episode_budget`)."""
    from rlft.envs.registry import environment_record

    s, e = cfg.sampling, cfg.environment
    if evaluation and s.eval_max_tokens is not None:
        turn = (s.eval_max_tokens, "sampling.eval_max_tokens")
    else:
        turn = (s.max_tokens, "sampling.max_tokens")
    multi_turn = environment_record(e.name).multi_turn and (e.evaluate_with_tools or not evaluation)
    if multi_turn and e.max_episode_tokens is not None:
        return e.max_episode_tokens, "environment.max_episode_tokens"
    return turn


def model_positions(cfg: RunConfig, model_dir: Path) -> int | None:
    """The most tokens (prompt and episode) the model in ``model_dir`` takes (its config.json), capped by
    the engine's settings where the engine is named (``sampling.backend``; ``auto`` is settled on the ranks)."""
    from rlft.engines import BACKENDS
    from rlft.models.families import read_config_json
    from rlft.models.loading import CONTEXT_FIELDS

    config = read_config_json(model_dir) or {}
    config = config.get("text_config") or config
    found = next((v for v in (config.get(f) for f in CONTEXT_FIELDS) if isinstance(v, int) and v > 0), None)
    backend = BACKENDS.get(cfg.sampling.backend)
    limits = [v for v in (found, backend.context_limit(cfg) if backend is not None else None) if v]
    return min(limits) if limits else None


def _file_template(model_dir: Path, tools: bool) -> tuple[str, dict] | None:
    """The chat template in ``model_dir``'s files and the special tokens it is rendered with (None: no
    template read there), as transformers picks it (the ``tool_use`` one of several for tools)."""
    config = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        try:
            config.update(json.loads((model_dir / name).read_text()))
        except (OSError, ValueError):
            pass
    template = config.get("chat_template")
    if (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    elif isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("tool_use") if tools and "tool_use" in named else named.get("default")
    special = {k: v.get("content") if isinstance(v, dict) else v for k, v in config.items()
               if k.endswith("_token") and isinstance(v, (str, dict))}
    return (template, special) if isinstance(template, str) else None


class _FileTemplate:
    """``apply_chat_template`` rendered from the model's files alone (transformers' own jinja rendering,
    without loading torch or the tokenizer): for an upper bound of the opening's tokens."""

    def __init__(self, template: str, special: dict) -> None:
        self.template, self.special = template, special
        self.chat_template = template  # as a tokenizer names it (rlft/envs/tool_block.py reads it)

    def apply_chat_template(self, conversation, tools=None, tokenize=False, add_generation_prompt=True, **kwargs):
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template([conversation], tools=tools, chat_template=self.template,
                                            add_generation_prompt=add_generation_prompt, **{**self.special, **kwargs})
        return rendered[0]


def opening_tokens(cfg: RunConfig, model_dir: Path, room: int) -> int | None:
    """The tokens of the training environment's opening on an empty question, the least any first-turn
    prompt holds, rendered and tokenised as the episode driver does (``EpisodeStart.token_ids``); None
    where it surely fits in ``room`` (its text's bytes, no tokenizer needed) or ``model_dir`` has no
    tokenizer files."""
    from rlft.envs.demonstrations import training_environment

    start = training_environment(cfg).open("", "")
    found = _file_template(model_dir, bool(start.tools)) if start.is_chat else ("", {})
    if found is not None:  # a token holds at least a byte (plus a leading piece and a BOS): no tokenizer to load
        if len(start.render(_FileTemplate(*found)).encode("utf-8")) + 4 <= room:
            return None
    if not any((model_dir / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return len(start.token_ids(AutoTokenizer.from_pretrained(model_dir)))


def check_first_turn_fits(cfg: RunConfig, model_dir: Path | None) -> None:
    """Refuse a run in which no first-turn prompt leaves room for the episode's budget (see above)."""
    context = model_positions(cfg, model_dir) if model_dir is not None else None
    if context is None:
        return  # the ranks check it, with the model's config at hand
    budget, key = episode_budget_of(cfg)
    if budget >= context:
        raise ConfigError(f"{key}: {budget} response tokens leave no room for a prompt in the model's "
                          f"{context} positions")
    opening = opening_tokens(cfg, model_dir, context - budget)
    if opening is not None and opening + budget > context:
        from rlft.envs.rollout_options import DEMONSTRATION_SCHEDULES

        e = cfg.environment
        shown = " with its demonstration" if DEMONSTRATION_SCHEDULES[e.demonstrations].annealed else ""
        raise ConfigError(f"{key}: the first-turn prompt takes at least {opening} tokens (environment {e.name}'s "
                          f"opening{shown}, before any question) and {key} {budget} more: {opening + budget} > the "
                          f"model's {context} positions; lower {key} to at most {context - opening} minus the question's tokens")
