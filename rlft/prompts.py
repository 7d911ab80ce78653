"""Prompt templates and the SFT target format.

The output contract is the R1-Zero one: the prompt ends with ``Assistant: <think>``, and the model
continues with its reasoning, ``</think>``, then ``<answer> ... </answer>``. The reward function
grades exactly that shape, and :func:`format_sft_target` rewrites GSM8K reference solutions into it
so supervised fine-tuning teaches the same contract.
"""

from __future__ import annotations

import re

import logging

from rlft.data import LoadResult, parse_gsm8k_ground_truth

logger = logging.getLogger(__name__)

# The reason a row is skipped when its prompt leaves no room for the response (LoadResult.skipped).
SKIP_PROMPT_TOO_LONG = "prompt_too_long"

R1_ZERO_PROMPT = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the User with the answer. The reasoning process is enclosed within <think> </think> "
    "and answer is enclosed within <answer> </answer> tags, respectively, i.e., <think> reasoning "
    "process here </think> <answer> answer here </answer>.\n"
    "User: {question}\n"
    "Assistant: <think>"
)

# A plain question/answer template, handy for base models and quick sanity checks; it asks for the
# same tags so the same reward function applies.
QUESTION_ONLY_PROMPT = (
    "Solve the problem. Think inside <think> </think>, then give the final number inside "
    "<answer> </answer>.\nQuestion: {question}\n<think>"
)

# The R1-Zero ending without its instructions: for models already taught the contract (e.g. by SFT)
# and for short test prompts.
R1_SHORT_PROMPT = "User: {question}\nAssistant: <think>"

PROMPT_TEMPLATES: dict[str, str] = {
    "r1_zero": R1_ZERO_PROMPT,
    "question_only": QUESTION_ONLY_PROMPT,
    "r1_short": R1_SHORT_PROMPT,
}


def get_template(template: str) -> str:
    """Return the template string for a registered name, or ``template`` itself when it is a
    literal template containing ``{question}``.

    Raises:
        ValueError: neither a registered name nor a string with a ``{question}`` placeholder.
    """
    if template in PROMPT_TEMPLATES:
        return PROMPT_TEMPLATES[template]
    if "{question}" in template:
        return template
    raise ValueError(
        f"unknown prompt template {template!r}: use one of {sorted(PROMPT_TEMPLATES)} "
        "or a literal template string containing '{question}'"
    )


def format_prompt(question: str, template: str = "r1_zero") -> str:
    """Fill ``question`` into a template (a registered name or a literal with ``{question}``).

    Only the ``{question}`` placeholder is substituted (``str.replace``, not ``str.format``), so
    braces in the question or in a literal template are kept as they are.
    """
    return get_template(template).replace("{question}", question)


# GSM8K solutions carry calculator annotations such as ``<<48/2=24>>`` in front of each result.
_CALC_ANNOTATION = re.compile(r"<<[^<>]*>>")


def format_sft_target(solution: str) -> str | None:
    """Turn a GSM8K solution ``"...reasoning...\\n#### 72"`` into the R1-Zero completion
    ``" {reasoning} </think> <answer> {final} </answer>"``.

    The text continues a prompt that ends in ``<think>``, hence the leading space. Calculator
    annotations are removed and the final answer is normalised like the ground truth (commas
    dropped, so ``"1,080"`` becomes ``"1080"``). Line breaks inside the reasoning are kept.

    Returns None when the solution has no ``####`` line or its final answer is not a number.
    """
    if "####" not in solution:
        return None
    final = parse_gsm8k_ground_truth(solution)
    if final is None:
        return None
    reasoning = solution.rsplit("####", 1)[0]
    reasoning = _CALC_ANNOTATION.sub("", reasoning).strip()
    return f" {reasoning} </think> <answer> {final} </answer>"


def prompt_token_limit(context: int | None, response_tokens: int, what: str = "sampling.max_tokens") -> int | None:
    """The most prompt tokens that leave room for `response_tokens` in a model taking `context`
    tokens (None: no limit known).  Raises ValueError when no prompt fits."""
    if context is None:
        return None
    if response_tokens >= context:
        raise ValueError(f"{what}: {response_tokens} response tokens leave no room for a prompt in the model's "
                         f"{context} positions")
    return context - response_tokens


def drop_long_prompts(loaded: LoadResult, tokenizer, template: str, max_prompt_tokens: int | None,
                      what: str, chunk_size: int = 1024) -> LoadResult:
    """`loaded` without the examples whose prompt (the question in `template`, tokenised as the
    engines receive it) is longer than `max_prompt_tokens`: they are counted under
    `skipped["prompt_too_long"]` and summarised in one warning, like broken rows.  A prompt too
    long for the model would otherwise fail the step or evaluation that draws it."""
    if max_prompt_tokens is None or not loaded.examples:
        return loaded
    kept = []
    for lo in range(0, len(loaded.examples), chunk_size):
        chunk = loaded.examples[lo:lo + chunk_size]
        ids = tokenizer([format_prompt(ex.question, template) for ex in chunk])["input_ids"]
        kept += [ex for ex, p in zip(chunk, ids) if len(p) <= max_prompt_tokens]
    dropped = len(loaded.examples) - len(kept)
    if not dropped:
        return loaded
    skipped = dict(loaded.skipped)
    skipped[SKIP_PROMPT_TOO_LONG] = skipped.get(SKIP_PROMPT_TOO_LONG, 0) + dropped
    logger.warning("%s: skipped %d rows whose prompt is longer than %d tokens (%s); kept %d",
                   what, dropped, max_prompt_tokens, SKIP_PROMPT_TOO_LONG, len(kept))
    return LoadResult(kept, skipped)
