"""Generated problems: ``reasoning_gym``'s tasks with a numeric answer, offline and deterministic for a seed.

* ``gsm_symbolic`` — ``reasoning_gym``'s generator of GSM8K-derived problems, the default when no
  data is at hand.
* ``reasoning_gym:TASK`` or ``reasoning_gym:TASK?key=value&key=value`` — any other ``reasoning_gym``
  task with a numeric answer, with the generator's options (e.g.
  ``reasoning_gym:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=2``, the CPU demo's easy
  task).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from rlft.data.examples import (
    SKIP_NON_NUMERIC_ANSWER,
    Example,
    LoadResult,
    parse_gsm8k_ground_truth,
    plain_number,
    warn_skipped,
)

GSM_SYMBOLIC = "gsm_symbolic"
REASONING_GYM_PREFIX = "reasoning_gym:"

# Problems generated for the "test" split use seed + this offset, so that train and test differ
# while both stay reproducible from the one configured seed.
GSM_SYMBOLIC_TEST_SEED_OFFSET = 1_000_003
# gsm_symbolic sizes used when the caller gives none.
GSM_SYMBOLIC_DEFAULT_SIZE = {"train": 2000, "test": 500}


def parse_reasoning_gym_source(source: str) -> tuple[str, dict[str, Any]] | None:
    """``"gsm_symbolic"`` -> ``("gsm_symbolic", {})``; ``"reasoning_gym:chain_sum?max_terms=2"`` ->
    ``("chain_sum", {"max_terms": 2})`` (values read as YAML scalars); None for any other source.

    Raises:
        ValueError: a ``reasoning_gym:`` source without a task name or with a malformed option.
    """
    if source == GSM_SYMBOLIC:
        return GSM_SYMBOLIC, {}
    if not source.startswith(REASONING_GYM_PREFIX):
        return None
    import yaml

    task, _, query = source[len(REASONING_GYM_PREFIX):].partition("?")
    if not re.fullmatch(r"[a-z0-9_]+", task):
        raise ValueError(f"data source {source!r}: expected reasoning_gym:TASK[?key=value&...]")
    options: dict[str, Any] = {}
    for item in filter(None, query.split("&")):
        key, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"data source {source!r}: option {item!r} is not key=value")
        options[key] = yaml.safe_load(value)
    return task, options


def load_reasoning_gym(task: str, size: int, seed: int, options: dict[str, Any] | None = None) -> LoadResult:
    """Generate ``size`` problems of a ``reasoning_gym`` task (``gsm_symbolic`` by default).

    Deterministic for a seed. ``solution`` is the generator's worked solution (GSM8K style, ending
    in ``#### <answer>``) when it has one that agrees with the answer; tasks without one get the
    short solution ``"The answer is N.\n#### N"``, enough for SFT to teach the output contract. A
    problem whose answer is not a plain number is skipped and counted, so fewer than ``size``
    examples may come back.

    Raises:
        ValueError: the size is not positive, the task is unknown, or the generator refuses the options.
    """
    import reasoning_gym

    if size <= 0:
        raise ValueError(f"{task} size must be positive, got {size}")
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **(options or {}))
    except (ValueError, TypeError, AssertionError, KeyError) as e:
        raise ValueError(f"reasoning_gym task {task!r} with options {options or {}}: {e}") from None
    skipped: Counter = Counter()
    examples = []
    for index in range(size):
        entry = dataset[index]
        truth = plain_number(str(entry["answer"]))
        if truth is None:
            skipped[SKIP_NON_NUMERIC_ANSWER] += 1
            continue
        # gsm_symbolic's worked solution ends in "#### <answer>" like GSM8K's, so SFT can use it.
        cot = entry.get("metadata", {}).get("answer_cot")
        cot_truth = parse_gsm8k_ground_truth(cot) if isinstance(cot, str) else None
        # Some templates write "#### 8.0" for the answer "8": compare values, not text.
        if cot_truth is not None and float(cot_truth) == float(truth):
            solution = cot
        elif task == GSM_SYMBOLIC:
            solution = None
        else:
            solution = f"The answer is {truth}.\n#### {truth}"
        name = task if not options else f"{REASONING_GYM_PREFIX}{task}"
        examples.append(Example(question=entry["question"], ground_truth=truth, solution=solution,
                                source=name, index=index))
    result = LoadResult(examples, dict(skipped))
    warn_skipped(result, f"{task} (seed {seed})")
    return result


def load_gsm_symbolic(size: int, seed: int) -> LoadResult:
    """``size`` generated GSM8K-style problems (``reasoning_gym``'s ``gsm_symbolic``)."""
    return load_reasoning_gym(GSM_SYMBOLIC, size, seed)
