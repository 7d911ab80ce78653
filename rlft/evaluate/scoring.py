"""The evaluation library: score a model's answers on a set of questions -- generate, grade,
summarise, write.

The same functions serve the stand-alone command line (``python -m rlft.evaluate``) and the
evaluator role during training (:class:`rlft.roles.evaluator.Evaluator`), which keeps one engine
resident:

    records, summary = evaluate(engine, tokenizer, examples, spec=spec, k=1)
    write_results(out_dir, records, summary)

Metrics (``n`` samples per question, ``n >= k``):

* ``accuracy`` — mean ``answer_reward`` over all samples: the pass@1 estimate.
* ``format_rate`` / ``mean_reward`` / ``mean_response_length`` — means over all samples
  (response length in generated tokens, counted from the engine's token ids).
* ``pass@k`` — mean over questions of the unbiased estimator ``1 - C(n-c, k) / C(n, k)``
  (``c`` correct samples of ``n``); with ``n == k`` it is "at least one sample correct".
* ``accuracy_lenient`` / ``pass@k_lenient`` — the same, with a sample correct when it is right
  strictly or by a lenient reading: its last marked answer (box, answer tags, ``####`` line) or the
  last number anywhere in it, graded by the same rules (:mod:`rlft.reward.lenient`).

A sample is *correct* when its ``answer_reward`` is 1, the quantity ``accuracy`` averages: the
answer format's contract, what the reward pays (strict).

Every sample is a rollout row of an environment (:func:`rlft.envs.rollouts.play_rows`, as in training):
by default the single-turn one, one completion of the prompt; with a multi-turn environment
(``evaluate(..., environment=...)``, e.g. the calculator) an episode, its last turn graded as above, and
the records and the summary then also hold the episodes' figures (tool call rate, tool calls and
errors per episode, accuracy with and without a tool call: :mod:`rlft.evaluate.episodes`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from rlft.data import Example
from rlft.engines.base import SamplingSpec
from rlft.envs.base import Environment, SingleTurnEnvironment
from rlft.envs.rollouts import RolloutRow, play_rows
from rlft.evaluate.episodes import add_episode_figures
from rlft.reward.grader import grade_batch
from rlft.data.prompts import DEFAULT_PROMPT_TEMPLATE, Prompt
from rlft.reward.formats import DEFAULT_ANSWER_FORMAT
from rlft.reward.lenient import lenient_correct

logger = logging.getLogger(__name__)

RESULTS_FILE = "results.jsonl"
SUMMARY_FILE = "summary.json"

__all__ = [
    "RESULTS_FILE",
    "SUMMARY_FILE",
    "evaluate",
    "pass_at_k",
    "score_responses",
    "tokenize_prompts",
    "write_results",
]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of the chance that at least one of ``k`` samples is correct, given
    ``c`` correct among ``n`` drawn samples: ``1 - C(n-c, k) / C(n, k)`` (Chen et al., 2021).

    With ``n == k`` this is 1.0 when ``c > 0`` and 0.0 otherwise.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"number correct must be between 0 and n={n}, got {c}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _is_correct(grade: dict) -> bool:
    return float(grade["answer_reward"]) >= 1.0


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def score_responses(
    examples: Sequence[Example],
    responses: Sequence[Sequence[str]],
    response_lengths: Sequence[Sequence[int]],
    *,
    k: int = 1,
    answer_format: str = DEFAULT_ANSWER_FORMAT,
) -> tuple[list[dict], dict]:
    """Grade ``n`` sampled responses per example (in ``answer_format``) and summarise them.

    Args:
        examples: E problems (their ``ground_truth`` is graded against).
        responses: E lists of ``n`` response texts each (the same ``n`` for every example).
        response_lengths: E lists of ``n`` generated-token counts, aligned with ``responses``.
        k: the k of pass@k; requires ``k <= n``.

    Returns:
        ``(records, summary)``. One record per example: ``index, question, ground_truth,
        responses, response`` (the first sample), ``format_reward, answer_reward, reward,
        response_length`` (all of the first sample), ``answer_reward_lenient`` (the first
        sample's), ``num_correct`` and ``num_correct_lenient`` (over the ``n`` samples) and the
        per-sample lists ``format_rewards, answer_rewards, answer_rewards_lenient, rewards,
        response_lengths`` (so every summary number can be recomputed from the records). The
        summary holds ``num_examples, num_samples, k, accuracy, format_rate, mean_reward,
        mean_response_length, pass@k, accuracy_lenient, pass@k_lenient``.
    """
    n = _samples_per_example(examples, responses, response_lengths, k)

    grades, lenient = _grade_all(examples, responses, n, answer_format)

    records: list[dict] = []
    pass_values: list[float] = []
    lenient_pass: list[float] = []
    for i, ex in enumerate(examples):
        sample_grades = grades[i * n:(i + 1) * n]
        sample_lenient = [float(ok) for ok in lenient[i * n:(i + 1) * n]]
        num_correct = sum(_is_correct(g) for g in sample_grades)
        pass_values.append(pass_at_k(n, num_correct, k))
        lenient_pass.append(pass_at_k(n, int(sum(sample_lenient)), k))
        records.append(_example_record(ex, responses[i], response_lengths[i], sample_grades, sample_lenient,
                                       num_correct))

    flat_lengths = [int(x) for lengths in response_lengths for x in lengths]
    summary = {
        "num_examples": len(examples),
        "num_samples": n,
        "k": k,
        "accuracy": _mean([float(g["answer_reward"]) for g in grades]),
        "format_rate": _mean([float(g["format_reward"]) for g in grades]),
        "mean_reward": _mean([float(g["reward"]) for g in grades]),
        "mean_response_length": _mean(flat_lengths),
        "pass@k": _mean(pass_values),
        "accuracy_lenient": _mean([float(ok) for ok in lenient]),
        "pass@k_lenient": _mean(lenient_pass),
    }
    return records, summary


def _grade_all(examples: Sequence[Example], responses: Sequence[Sequence[str]], n: int,
               answer_format: str) -> tuple[list[dict], list[bool]]:
    """Every sample's grade and lenient verdict, flat in example order (``n`` per example)."""
    # Grade everything in one call so the grader's batch time bound covers the whole set.
    flat_texts = [text for texts in responses for text in texts]
    flat_truths = [ex.ground_truth for ex in examples for _ in range(n)]
    grades = grade_batch(flat_texts, flat_truths, answer_format=answer_format)
    if len(grades) != len(flat_texts):
        raise RuntimeError(f"grader returned {len(grades)} grades for {len(flat_texts)} responses")
    return grades, lenient_correct(flat_texts, flat_truths, grades)


def _samples_per_example(examples: Sequence[Example], responses: Sequence[Sequence[str]],
                         response_lengths: Sequence[Sequence[int]], k: int) -> int:
    """The number of samples ``n`` every example has, once the responses and their lengths pair up
    with the examples, every example has the same ``n`` and ``1 <= k <= n``."""
    if len(responses) != len(examples) or len(response_lengths) != len(examples):
        raise ValueError(
            f"need one list of responses and of lengths per example: {len(examples)} examples, "
            f"{len(responses)} response lists, {len(response_lengths)} length lists"
        )
    if not examples:
        raise ValueError("cannot score an empty set of examples")
    n = len(responses[0])
    for i, (texts, lengths) in enumerate(zip(responses, response_lengths)):
        if len(texts) != n or len(lengths) != n:
            raise ValueError(
                f"example {i} has {len(texts)} responses and {len(lengths)} lengths; every example "
                f"needs the same number of samples ({n}, as example 0)"
            )
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs at least k={k} samples per example, got {n}")
    return n


def _example_record(ex: Example, texts: Sequence[str], lengths: Sequence[int], sample_grades: list[dict],
                    sample_lenient: list[float], num_correct: int) -> dict:
    """One example's record (see :func:`score_responses`): its first sample's figures, the counts
    of correct samples and every sample's figures."""
    first = sample_grades[0]
    return {
        "index": ex.index,
        "question": ex.question,
        "ground_truth": ex.ground_truth,
        "responses": list(texts),
        "response": texts[0],
        "format_reward": float(first["format_reward"]),
        "answer_reward": float(first["answer_reward"]),
        "reward": float(first["reward"]),
        "num_correct": int(num_correct),
        "answer_reward_lenient": sample_lenient[0],
        "num_correct_lenient": int(sum(sample_lenient)),
        "response_length": int(lengths[0]),
        "format_rewards": [float(g["format_reward"]) for g in sample_grades],
        "answer_rewards": [float(g["answer_reward"]) for g in sample_grades],
        "answer_rewards_lenient": sample_lenient,
        "rewards": [float(g["reward"]) for g in sample_grades],
        "response_lengths": [int(x) for x in lengths],
    }


def tokenize_prompts(tokenizer: Any, questions: Sequence[str], template: str | Prompt) -> list[list[int]]:
    """Prompt token ids, one list per question (:meth:`rlft.data.prompts.Prompt.encode`)."""
    prompt = template if isinstance(template, Prompt) else Prompt(template)
    return prompt.encode(list(questions), tokenizer)


def evaluate(
    engine: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    *,
    spec: SamplingSpec,
    k: int = 1,
    batch_size: int | None = None,
    prompt_template: str | Prompt = DEFAULT_PROMPT_TEMPLATE,
    progress: bool = True,
    environment: Environment | None = None,
    max_turns: int = 4,
    max_episode_tokens: int | None = None,
) -> tuple[list[dict], dict]:
    """Generate responses for ``examples`` with ``engine`` and score them.

    Args:
        engine: a ``RolloutEngine`` (``generate(prompt_token_ids, spec) -> list[list[Completion]]``).
        tokenizer: the model's tokenizer, used for the prompts only; response lengths come from
            the engine's token ids, never from re-tokenising text.
        examples: the problems.
        spec: sampling parameters. ``spec.n`` is raised to ``k`` when smaller, so each question
            gets ``n = max(spec.n, k)`` samples.
        k: the k of pass@k.
        batch_size: prompts per ``generate`` call (each carries ``n`` samples); None: all at once,
            which lets an engine like vLLM schedule the whole set (its own batching is the fast path).
        prompt_template: a registered template name, a literal with ``{question}``, or a
            :class:`~rlft.data.prompts.Prompt` (whose answer format the grading then uses).
        progress: show a progress bar over questions.
        environment: the :class:`~rlft.envs.base.Environment` whose episodes the samples are (its
            opening is the prompt, with its tools), at most ``max_turns`` turns and
            ``max_episode_tokens`` tokens after the prompt (None: ``spec.max_tokens``); the last turn
            is graded and the response length counts the model's tokens.  None: the single-turn
            environment of ``prompt_template`` (one completion of the prompt per sample).  A
            multi-turn one's figures are added by :func:`rlft.evaluate.episodes.add_episode_figures`.

    Returns:
        ``(records, summary)`` as from :func:`score_responses`, the summary extended with
        ``seconds`` (generation + grading wall time) and ``examples_per_s``.
    """
    spec = _checked_spec(spec, k, batch_size, len(examples))
    start = time.perf_counter()
    prompt = prompt_template if isinstance(prompt_template, Prompt) else Prompt(prompt_template)
    environment = environment if environment is not None else SingleTurnEnvironment(prompt)
    caps = dict(max_turns=max_turns, max_episode_tokens=max_episode_tokens or spec.max_tokens)
    groups = _generate(engine, tokenizer, examples, spec, environment, batch_size or len(examples), progress, caps)
    responses = [[row.text for row in group] for group in groups]
    # Generated tokens, from the engine's ids: the model's own (an episode's tool replies left out).
    lengths = [[row.episode.model_tokens for row in group] for group in groups]
    records, summary = score_responses(examples, responses, lengths, k=k, answer_format=prompt.answer_format)
    if environment.multi_turn:  # turns and tool calls: a multi-turn environment's figures
        add_episode_figures(records, summary, [[row.episode for row in group] for group in groups], tokenizer,
                            answer_format=prompt.answer_format)
    seconds = time.perf_counter() - start
    summary["seconds"] = seconds
    summary["examples_per_s"] = len(examples) / max(seconds, 1e-9)
    return records, summary


def _checked_spec(spec: SamplingSpec, k: int, batch_size: int | None, num_examples: int) -> SamplingSpec:
    """``spec`` with ``n`` raised to ``k`` when smaller; ValueError for a bad ``k``, ``batch_size`` or no
    examples."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    if not num_examples:
        raise ValueError("cannot evaluate an empty set of examples")
    n = max(spec.n, k)
    if n != spec.n:
        spec = dataclasses.replace(spec, n=n)
    if n > 1 and spec.temperature == 0:
        logger.warning("greedy decoding (temperature 0) with %d samples per question: the samples "
                       "are identical, so pass@%d equals accuracy", n, k)
    return spec


def _generate(engine: Any, tokenizer: Any, examples: Sequence[Example], spec: SamplingSpec,
              environment: Environment, batch_size: int, progress: bool, caps: dict) -> list[list[RolloutRow]]:
    """``spec.n`` rows per example, episodes of ``environment`` within ``caps`` (``max_turns``,
    ``max_episode_tokens``), ``batch_size`` examples per call of :func:`rlft.envs.rollouts.play_rows`."""
    from tqdm.auto import tqdm

    groups: list[list[RolloutRow]] = []
    with tqdm(total=len(examples), desc="eval", unit="q", disable=not progress, dynamic_ncols=True) as bar:
        for lo in range(0, len(examples), batch_size):
            outputs = play_rows(engine, environment, examples[lo:lo + batch_size], spec, tokenizer, **caps)
            wanted = min(batch_size, len(examples) - lo)
            if len(outputs) != wanted:
                raise RuntimeError(f"engine returned {len(outputs)} outputs for {wanted} prompts")
            for completions in outputs:
                if len(completions) != spec.n:
                    raise RuntimeError(f"engine returned {len(completions)} samples for a prompt, "
                                       f"expected n={spec.n}")
                groups.append(list(completions))
            bar.update(wanted)
    return groups


def _atomic_write_text(path: Path, text: str) -> None:
    """Write via a temporary file in the same directory and rename, so a reader never sees a
    half-written file (and an interrupted run leaves the previous one intact)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_results(out_dir: str | os.PathLike, records: Sequence[dict], summary: dict) -> tuple[Path, Path]:
    """Write ``results.jsonl`` (one line per example) and ``summary.json`` into ``out_dir``
    (created if needed), each atomically. Returns the two paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path, summary_path = out / RESULTS_FILE, out / SUMMARY_FILE
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    _atomic_write_text(results_path, lines)
    _atomic_write_text(summary_path, json.dumps(summary, indent=2) + "\n")
    return results_path, summary_path
