"""What `launch/train.sh` refuses because the run would end with exit status 0 having learnt nothing.

* :func:`check_reward_fn`: a ``reward.fn`` of the user's is called once on a real training row (the
  first usable one of a local file, else a fixed probe question), with the right answer and with a
  wrong one, each written in the run's answer format.  A function that raises, does not return a
  reward, takes longer than ``reward.timeout_s``, or gives the right and the wrong answer the same
  reward would score every rollout alike: no group has an advantage, no step a gradient.
* :func:`check_answer_budget`: a token budget per response (``sampling.max_tokens``, and for
  multi-turn environments ``environment.max_episode_tokens``) shorter than the shortest well-formed
  answer of the answer format (counted with the model's own tokenizer when its files are here, and
  only when the budget is below the answer's bytes, which no tokenizer exceeds by more than a piece):
  every response is cut before its answer, every reward is 0.

* :func:`check_prompt_asks_for_the_format`: a text template that asks for another answer format
  than ``reward.answer_format`` grades (``r1_zero`` names ``<answer> </answer>``; graded as ``boxed``
  every response scores 0).

Each raises :class:`~rlft.config.ConfigError` with one line.  Nothing here imports torch.
"""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from rlft.config.schema import ConfigError, RunConfig

# The row the probe uses where the data is not a local file (generated problems, a hub dataset).
PROBE_QUESTION, PROBE_GOLD = "Tom has 3 apples and buys 4 more. How many apples does he have?", "7"
# The longest the probe's first call may take (a slow first call may load something once).
PROBE_DEADLINE_S = 30.0


def probe_row(cfg: RunConfig) -> tuple[str, str]:
    """(question, ground truth) of the first usable row of a local training split, else the probe's."""
    from rlft.data.rows import RowMapping, first_rows, is_generated
    from rlft.data.sources import split_files

    d = cfg.data
    path = Path(d.source).expanduser()
    if is_generated(d.source) or not path.exists():
        return PROBE_QUESTION, PROBE_GOLD
    files = [path] if path.is_file() else split_files(path, d.train_split)
    reader = RowMapping.of(d).reader(str(files[0])) if files else None
    for index, row in enumerate((first_rows(files[0]) or []) if files else []):
        example = reader.example(row, index, Counter())
        if example is not None:
            return example.question, example.ground_truth
    return PROBE_QUESTION, PROBE_GOLD


def wrong_answer(gold: str) -> str:
    """An answer that is not ``gold``: the number plus one, or a number where the gold is none."""
    from rlft.data.examples import plain_number

    number = plain_number(gold)
    if number is None:
        return "0" if gold.strip() not in ("0", "0.0") else "1"
    return str(int(number) + 1) if "." not in number else str(float(number) + 1)


def check_reward_fn(cfg: RunConfig) -> None:
    """Refuse a custom ``reward.fn`` that cannot tell a right answer from a wrong one (see above)."""
    from rlft.common import quoted
    from rlft.envs.guard import EnvironmentCallError, call_with_deadline
    from rlft.reward.formats import get_answer_format
    from rlft.reward.functions import DEFAULT_REWARD_FN
    from rlft.reward.worker import import_function, reward_value

    r = cfg.reward
    if r.fn.strip() == DEFAULT_REWARD_FN:
        return
    fn, fmt = import_function(r.fn), get_answer_format(r.answer_format)
    question, gold = probe_row(cfg)
    wrong = wrong_answer(gold)
    where = f"on the training question {quoted(question)} (gold {gold!r})"
    rewards = {}
    for label, answer in (("right", gold), ("wrong", wrong)):
        response = fmt.sft_target("Let me work it out.", answer, False)
        started = time.monotonic()
        try:
            value = call_with_deadline(fn, (response, gold), max(PROBE_DEADLINE_S, r.timeout_s), "")
            rewards[label] = reward_value(value)["reward"]
        except EnvironmentCallError:
            raise ConfigError(f"reward.fn: {r.fn} did not return within {max(PROBE_DEADLINE_S, r.timeout_s):g} s "
                              f"{where}") from None
        except Exception as err:  # noqa: BLE001 - the user's function failed: one line
            text = " ".join(str(err).split())[:200]
            raise ConfigError(f"reward.fn: {r.fn} raised {type(err).__name__}: {text} {where} with the {label} "
                              f"answer {answer!r}; every rollout would score 0") from None
        took = time.monotonic() - started
        if label == "wrong" and took > r.timeout_s:  # the first call may load something once
            raise ConfigError(f"reward.fn: {r.fn} took {took:.1f} s for one response, more than reward.timeout_s "
                              f"({r.timeout_s:g}); every rollout would time out and score 0: raise reward.timeout_s")
    if rewards["right"] == rewards["wrong"]:
        raise ConfigError(f"reward.fn: {r.fn} gives the right answer {gold!r} and a wrong one {wrong!r} the same "
                          f"reward ({rewards['right']:g}) {where}: no group would have an advantage to learn from")


def answer_tokens(text: str, model_dir: Path | None) -> tuple[int, str]:
    """``text``'s number of tokens and how it was counted: with ``model_dir``'s tokenizer.json, else
    a lower bound (one token per 4 characters, rounded down, at least 1)."""
    if model_dir is not None and (model_dir / "tokenizer.json").is_file():
        try:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
            return len(tokenizer.encode(text, add_special_tokens=False).ids), "the model's tokenizer"
        except Exception:  # noqa: BLE001 - an unreadable tokenizer: its own check names it
            pass
    return max(1, len(text) // 4), "at least"


def check_answer_budget(cfg: RunConfig, model_dir: Path | None) -> None:
    """Refuse a token budget per response below the shortest well-formed answer (see above)."""
    from rlft.envs.registry import environment_record
    from rlft.reward.formats import get_answer_format, shortest_answer

    fmt = get_answer_format(cfg.reward.answer_format)
    text = shortest_answer(fmt)
    s, e = cfg.sampling, cfg.environment
    budgets = [(s.max_tokens, "sampling.max_tokens")]
    if environment_record(e.name).multi_turn and e.episode_tokens(s.max_tokens) < s.max_tokens:
        budgets = [(e.episode_tokens(s.max_tokens), "environment.max_episode_tokens")]
    if s.eval_max_tokens is not None:  # the evaluation's own budget: every answer cut would read as accuracy 0
        budgets.append((s.eval_max_tokens, "sampling.eval_max_tokens"))
    if min(b for b, _ in budgets) >= len(text.encode("utf-8")) + 2:
        return  # a token holds at least a byte (plus a tokenizer's leading piece): no tokenizer to load
    needed, how = answer_tokens(text, model_dir)
    for budget, key in budgets:
        if budget < needed:
            counted = f"{needed} tokens with {how}" if how != "at least" else f"at least {needed} tokens"
            raise ConfigError(f"{key}: {budget} tokens cannot hold an answer: the shortest well-formed answer of "
                              f"reward.answer_format {fmt.name}, {text!r}, takes {counted}; every response would be "
                              f"cut before its answer and score 0")


def check_prompt_asks_for_the_format(cfg: RunConfig) -> None:
    """Refuse a text template naming another format's marker and not the run's own (see above)."""
    from rlft.data.prompts import get_template, prompt_of
    from rlft.reward.formats import ANSWER_FORMATS, get_answer_format

    prompt = prompt_of(cfg)
    if prompt.is_chat:
        return  # a chat prompt asks in the format's own words (its instruction)
    text, fmt = get_template(prompt.template), get_answer_format(cfg.reward.answer_format)
    if not fmt.marker or fmt.marker in text:
        return
    asked = [f for f in ANSWER_FORMATS.values() if f.marker and f.marker in text]
    if asked:
        raise ConfigError(f"data.prompt_template: {cfg.data.prompt_template} asks for answers as {asked[0].name} "
                          f"({asked[0].marker}), but reward.answer_format {fmt.name} grades another ({fmt.description}): every "
                          f"response would score 0; set reward.answer_format={asked[0].name}, or a template asking "
                          f"for {fmt.name} (data.prompt_template=chat adds its instruction)")
