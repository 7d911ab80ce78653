"""Every default is named once: a parameter or a config field whose default is the run's answer format,
prompt template, model, reward function, data source, KL estimator, aggregation or advantage estimator
reads the constant that names it, so that changing the default is one edit."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlft"


def named_defaults() -> dict[str, str]:
    """value -> the constant that names it."""
    from rlft.data import GSM_SYMBOLIC
    from rlft.data.prompts import DEFAULT_PROMPT_TEMPLATE
    from rlft.grpo.choices import DEFAULT_ADVANTAGE_ESTIMATOR, DEFAULT_AGGREGATION, DEFAULT_KL_ESTIMATOR
    from rlft.models.loading import DEFAULT_MODEL
    from rlft.reward.formats import DEFAULT_ANSWER_FORMAT
    from rlft.reward.functions import DEFAULT_REWARD_FN

    names = {"DEFAULT_ANSWER_FORMAT": DEFAULT_ANSWER_FORMAT, "DEFAULT_PROMPT_TEMPLATE": DEFAULT_PROMPT_TEMPLATE,
             "DEFAULT_MODEL": DEFAULT_MODEL, "DEFAULT_REWARD_FN": DEFAULT_REWARD_FN, "GSM_SYMBOLIC": GSM_SYMBOLIC,
             "DEFAULT_KL_ESTIMATOR": DEFAULT_KL_ESTIMATOR, "DEFAULT_AGGREGATION": DEFAULT_AGGREGATION,
             "DEFAULT_ADVANTAGE_ESTIMATOR": DEFAULT_ADVANTAGE_ESTIMATOR}
    return {value: name for name, value in names.items()}


def spelled_defaults(source: str, values: dict[str, str]) -> list[tuple[int, str]]:
    """(line, value) of each function parameter or class field defaulting to one of `values` literally."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            defaults = [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
        elif isinstance(node, ast.ClassDef):
            defaults = [s.value for s in node.body if isinstance(s, (ast.AnnAssign, ast.Assign)) and s.value is not None]
        else:
            continue
        found += [(d.lineno, d.value) for d in defaults
                  if isinstance(d, ast.Constant) and isinstance(d.value, str) and d.value in values]
    return found


def test_the_defaults_are_read_from_their_constants():
    values = named_defaults()
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {value!r} (use {values[value]})"
             for path in sorted(PACKAGE.rglob("*.py"))
             for line, value in spelled_defaults(path.read_text(encoding="utf-8"), values)]
    assert not found, "\n".join(found)


def test_a_spelled_default_is_found():
    source = ('def grade(response, answer_format="r1_tags"):\n    pass\n'
              'class Section:\n    kl_estimator: str = "k3"\n    other: str = "k9"\n'
              'def fine(fmt=DEFAULT_ANSWER_FORMAT, *, aggregation="sequence"):\n    pass\n')
    assert spelled_defaults(source, named_defaults()) == [(1, "r1_tags"), (4, "k3"), (6, "sequence")]
