"""Answer formats: how a response states its final answer, and what counts as well-formed.

One format is chosen per run (``reward.answer_format``); the grader reads the answer with it, the
sampler stops where it says (``stop``), chat prompts ask for it (``instruction``) and SFT writes
its targets in it (``sft_target``).  Every format's answer is graded with the same number rules
(:mod:`rlft.reward.answers`).

=============  =============================================  ==========================  ==========
name           well-formed when                               the answer                  stops at
=============  =============================================  ==========================  ==========
``r1_tags``    ``</think> <answer>`` and ``</answer>`` occur  after the last ``<answer>``  ``</answer>``
``boxed``      a ``\\boxed{...}`` with balanced braces         the last box's content      (EOS)
``gsm8k``      a line starting with ``####``                  the rest of the last one    (EOS)
=============  =============================================  ==========================  ==========

``r1_tags`` is the original R1-Zero contract (base models with the R1-Zero prompt); ``boxed`` is
what instruct models write when asked to "put your final answer within \\boxed{}"; ``gsm8k`` is
the dataset's own solution format.  A new format is one :func:`register_answer_format` call here.
"""
from __future__ import annotations

from rlft.common import add_record

import re
from dataclasses import dataclass
from typing import Callable

from rlft.reward.answers import ANSWER_CLOSE, distinct_candidates, extract_boxed, split_response


@dataclass(frozen=True)
class AnswerFormat:
    """One way of stating the final answer.

    ``split(response) -> (well_formed, answer_or_None)``: the answer is None (graded wrong) when
    the response is well-formed but its answer cannot be read or names several candidates.
    ``stop``: the sampler's stop strings (kept in the output).  ``instruction``: appended to the
    question in chat prompts.  ``sft_target(reasoning, final, continues_think)``: the completion
    SFT teaches (``continues_think``: the prompt already ends with ``<think>``).  ``shortest``: the
    shortest well-formed answer (with a one-digit answer), which a response's token budget must hold.
    ``marker``: text a prompt asking for this format names (a text template naming another format's
    marker and not this one's asks for the wrong format).
    """

    name: str
    split: Callable[[str], tuple[bool, str | None]]
    stop: tuple[str, ...]
    instruction: str
    sft_target: Callable[[str, str, bool], str]
    description: str
    shortest: str = ""
    marker: str = ""


ANSWER_FORMATS: dict[str, AnswerFormat] = {}


def register_answer_format(fmt: AnswerFormat) -> AnswerFormat:
    return add_record(ANSWER_FORMATS, fmt, "answer format")


def shortest_answer(fmt: AnswerFormat) -> str:
    """The shortest well-formed answer of ``fmt`` (its own ``shortest``, else its SFT target with no
    reasoning and the answer 7)."""
    return fmt.shortest or fmt.sft_target("", "7", True).strip()


def get_answer_format(name: str) -> AnswerFormat:
    """The registered format ``name``; ValueError listing the choices otherwise."""
    try:
        return ANSWER_FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown answer format {name!r}: use one of {sorted(ANSWER_FORMATS)}") from None


# --------------------------------------------------------------------------- the registered formats

def split_boxed(response: str) -> tuple[bool, str | None]:
    """Well-formed: at least one balanced box.  The answer is the last box's content, unless the
    final paragraph (from the last blank line before the last box) boxes a different candidate too:
    ``\\boxed{18} or \\boxed{20}`` is no answer (listing candidates must not pay)."""
    answer = extract_boxed(response)
    if answer is None:
        return False, None
    last = max(response.rfind("\\boxed"), response.rfind("\\fbox"))
    paragraph = response[response.rfind("\n\n", 0, last) + 1:]
    if len(distinct_candidates(paragraph)) > 1:  # the same rule as every format's (18 and 18.0 agree)
        return True, None
    return True, answer


_HASH_LINE = re.compile(r"^[ \t]*####[ \t]*(?P<answer>[^\n]*)$", re.MULTILINE)


def split_gsm8k(response: str) -> tuple[bool, str | None]:
    """Well-formed: a line starting with ``####``; the answer is the rest of the last such line."""
    found = list(_HASH_LINE.finditer(response))
    if not found:
        return False, None
    answer = found[-1]["answer"].strip()
    return True, (answer or None)


R1_TAGS = register_answer_format(AnswerFormat(
    name="r1_tags",
    split=split_response,
    stop=(ANSWER_CLOSE,),
    instruction=("Think about the reasoning process inside <think> </think>, then give the final answer "
                 "inside <answer> </answer>, i.e. <think> reasoning here </think> <answer> answer here </answer>."),
    sft_target=lambda reasoning, final, continues_think: (
        f"{'' if continues_think else '<think>'} {reasoning} </think> <answer> {final} </answer>"),
    description="the R1-Zero contract: <think> ... </think> <answer> ... </answer>",
    shortest="</think> <answer>7</answer>",
    marker=ANSWER_CLOSE,
))
# reward.answer_format's default, and that of every function taking an answer format.
DEFAULT_ANSWER_FORMAT = R1_TAGS.name

register_answer_format(AnswerFormat(
    name="boxed",
    split=split_boxed,
    stop=(),
    instruction="Please reason step by step, and put your final answer within \\boxed{}.",
    sft_target=lambda reasoning, final, continues_think: f"{reasoning}\nThe final answer is $\\boxed{{{final}}}$.",
    description="the last \\boxed{...} holds the final answer",
    shortest="\\boxed{7}",
    marker="\\boxed",
))

register_answer_format(AnswerFormat(
    name="gsm8k",
    split=split_gsm8k,
    stop=(),
    instruction="Solve the problem step by step. On the last line, write #### followed by the final number.",
    sft_target=lambda reasoning, final, continues_think: f"{reasoning}\n#### {final}",
    description="GSM8K's own solution format: a last line '#### N'",
    shortest="#### 7",
    marker="####",
))
