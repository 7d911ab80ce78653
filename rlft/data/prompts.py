"""Prompts: how a question becomes the text the model continues, and the SFT target format.

Two kinds, for the two kinds of model rlft starts from:

* **Text templates** (base models): a literal string with ``{question}``, or a registered name.
  The seed's ``r1_zero`` ends with ``Assistant: <think>``; the model continues with its reasoning,
  ``</think>``, then ``<answer> ... </answer>`` (answer format ``r1_tags``).
* **Chat prompts** (instruct models): ``data.prompt_template: chat`` renders the messages with the
  tokenizer's own ``apply_chat_template`` (generation prompt added): an optional system message
  (``data.system_prompt``) and a user message = the question + the answer format's instruction
  (``reward.answer_format``, :mod:`rlft.reward.formats`).  ``data.prompt_messages`` gives the messages
  literally instead (``{question}`` and ``{instruction}`` are filled in).

:class:`Prompt` is the one object the sampler, the evaluator and SFT use; :func:`format_sft_target`
rewrites GSM8K reference solutions into the chosen answer format so SFT teaches what RL rewards.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from rlft.data.examples import LoadResult, parse_gsm8k_ground_truth
from rlft.reward.formats import DEFAULT_ANSWER_FORMAT, get_answer_format

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
# data.prompt_template's default (the seed's text prompt, for base models), and that of every function
# taking a template.
DEFAULT_PROMPT_TEMPLATE = "r1_zero"


CHAT = "chat"  # data.prompt_template: render with the tokenizer's chat template
# The roles every chat template renders; others (``wizard``, ``User``, ``human``, ``"user "``) are
# left out by some (Qwen2.5's), and the question with them.
CHAT_ROLES = ("system", "user", "assistant")
# A ``{name}`` that nothing fills in would stay in the prompt literally; ``\\boxed{x}`` is no placeholder.
_PLACEHOLDER = re.compile(r"(?<![\\\w])\{([A-Za-z_]\w*)\}")


def unknown_placeholders(text: str, known: tuple[str, ...]) -> list[str]:
    """The ``{name}`` placeholders in ``text`` other than ``known`` ones, as written."""
    return ["{" + name + "}" for name in _PLACEHOLDER.findall(text) if name not in known]


def get_template(template: str) -> str:
    """Return the template string for a registered name, or ``template`` itself when it is a
    literal template containing ``{question}``.

    Raises:
        ValueError: neither a registered name nor a string with a ``{question}`` placeholder.
    """
    if template in PROMPT_TEMPLATES:
        return PROMPT_TEMPLATES[template]
    if isinstance(template, str) and "{question}" in template:
        unknown = unknown_placeholders(template, ("question",))
        if unknown:
            raise ValueError(f"the template's placeholder {unknown[0]} is filled in by nothing and would stay in "
                             "every prompt as written: only {question} is filled in")
        return template
    raise ValueError(
        f"unknown prompt template {template!r}: use one of {sorted(PROMPT_TEMPLATES) + [CHAT]} "
        "or a literal template string containing '{question}'"
    )


@dataclass(frozen=True)
class Prompt:
    """How questions become prompts: a text template, or chat messages for the tokenizer's template.

    ``template``: a registered text template, a literal with ``{question}``, or ``"chat"``.
    ``messages``: literal chat messages (``{"role", "content"}``; ``{question}`` and
    ``{instruction}`` are filled in), which imply a chat prompt.  ``system``: the system message of
    ``"chat"`` (None: none).  ``answer_format``: whose instruction a chat prompt carries.
    """

    template: str = DEFAULT_PROMPT_TEMPLATE
    messages: tuple[tuple[str, str], ...] | None = None
    system: str | None = None
    answer_format: str = DEFAULT_ANSWER_FORMAT

    @property
    def is_chat(self) -> bool:
        return self.messages is not None or self.template == CHAT

    def check(self) -> None:
        """ValueError naming the problem when the template or the messages cannot be used."""
        get_answer_format(self.answer_format)
        if self.messages is not None:
            if not self.messages or not any("{question}" in content for _, content in self.messages):
                raise ValueError("the chat messages must be non-empty and one must contain '{question}'")
            for i, (role, content) in enumerate(self.messages):
                if role not in CHAT_ROLES:
                    raise ValueError(f"message {i + 1} has the role {role!r}, which chat templates need not render "
                                     f"(Qwen2.5's leaves it out, and its content with it): use one of "
                                     f"{', '.join(CHAT_ROLES)}")
                unknown = unknown_placeholders(content, ("question", "instruction"))
                if unknown:
                    raise ValueError(f"message {i + 1} has the placeholder {unknown[0]}, which is filled in by "
                                     "nothing and would stay in every prompt as written: only {question} and "
                                     "{instruction} are filled in")
        elif self.template != CHAT:
            get_template(self.template)

    def check_tokenizer(self, tokenizer, model: str = "the model") -> None:
        """ValueError (one line) when a chat prompt meets a tokenizer without a chat template, or
        one whose template refuses the messages or renders them without the question."""
        if not self.is_chat:
            return
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"a chat prompt needs a tokenizer with a chat template, and {model}'s tokenizer has "
                             "none: use a text template (e.g. data.prompt_template=r1_zero) for a base model")
        self._render_chat("How many legs do 3 spiders have?", tokenizer, model)

    def _render_chat(self, question: str, tokenizer, model: str = "the model") -> str:
        messages = self.chat_messages(question)
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - jinja2's TemplateError, or what the template raises
            raise ValueError(f"{model}'s chat template refuses the messages (roles "
                             f"{', '.join(m['role'] for m in messages)}): {' '.join(str(e).split())}") from None
        if question.strip() not in text:
            raise ValueError(f"{model}'s chat template renders the messages (roles "
                             f"{', '.join(m['role'] for m in messages)}) without the question: put {{question}} "
                             f"in a user message")
        return text

    def chat_messages(self, question: str) -> list[dict[str, str]]:
        instruction = get_answer_format(self.answer_format).instruction
        if self.messages is not None:
            return [{"role": role, "content": content.replace("{instruction}", instruction)
                     .replace("{question}", question)} for role, content in self.messages]
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": "user", "content": f"{question}\n{instruction}"}]

    def render(self, question: str, tokenizer=None) -> str:
        """The prompt text of ``question`` (a chat prompt needs the ``tokenizer``)."""
        if not self.is_chat:
            return get_template(self.template).replace("{question}", question)
        if tokenizer is None:
            raise ValueError("a chat prompt is rendered by the model's tokenizer; none was given")
        if not getattr(tokenizer, "chat_template", None):
            self.check_tokenizer(tokenizer)
        return self._render_chat(question, tokenizer)

    def encode(self, questions: list[str], tokenizer) -> list[list[int]]:
        """Prompt token ids, one list per question, as the engines receive them: a text prompt with the
        tokenizer's own special tokens (e.g. a BOS); a chat prompt exactly as its template wrote it
        (the template already holds any BOS)."""
        texts = [self.render(q, tokenizer) for q in questions]
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=not self.is_chat)["input_ids"]]

    @property
    def continues_think(self) -> bool:
        """The prompt itself opens the thinking block (the R1-Zero text templates)."""
        return not self.is_chat and get_template(self.template).rstrip().endswith("<think>")


def prompt_of(cfg) -> Prompt:
    """The run's :class:`Prompt` (``data.prompt_template`` / ``prompt_messages`` / ``system_prompt``
    and ``reward.answer_format``)."""
    d = cfg.data
    messages = None if d.prompt_messages is None else tuple((m["role"], m["content"]) for m in d.prompt_messages)
    return Prompt(d.prompt_template, messages, d.system_prompt, cfg.reward.answer_format)


def format_prompt(question: str, template: str | Prompt = DEFAULT_PROMPT_TEMPLATE, tokenizer=None) -> str:
    """Fill ``question`` into a template (a registered name, a literal with ``{question}``, or a
    :class:`Prompt`; a chat prompt needs the ``tokenizer``).

    Only the ``{question}`` placeholder is substituted (``str.replace``, not ``str.format``), so
    braces in the question or in a literal template are kept as they are.
    """
    prompt = template if isinstance(template, Prompt) else Prompt(template)
    return prompt.render(question, tokenizer)


# GSM8K solutions carry calculator annotations such as ``<<48/2=24>>`` in front of each result.
_CALC_ANNOTATION = re.compile(r"<<[^<>]*>>")


def format_sft_target(solution: str, prompt: Prompt | None = None) -> str | None:
    """Turn a GSM8K solution ``"...reasoning...\\n#### 72"`` into a completion in the prompt's
    answer format; by default (the R1-Zero prompt) ``" {reasoning} </think> <answer> {final} </answer>"``.

    That text continues a prompt that ends in ``<think>``, hence the leading space; after a chat
    prompt the R1 target opens its own ``<think>``, a ``boxed`` one ends in ``\\boxed{72}``.
    Calculator annotations are removed and the final answer is normalised like the ground truth
    (commas dropped, so ``"1,080"`` becomes ``"1080"``). Line breaks inside the reasoning are kept.

    Returns None when the solution has no ``####`` line or its final answer is not a number.
    """
    prompt = prompt or Prompt()
    if "####" not in solution:
        return None
    final = parse_gsm8k_ground_truth(solution)
    if final is None:
        return None
    reasoning = solution.rsplit("####", 1)[0]
    reasoning = _CALC_ANNOTATION.sub("", reasoning).strip()
    target = get_answer_format(prompt.answer_format).sft_target(reasoning, final, prompt.continues_think)
    return target.strip() if prompt.is_chat else target


def prompt_token_limit(context: int | None, response_tokens: int, what: str = "sampling.max_tokens") -> int | None:
    """The most prompt tokens that leave room for `response_tokens` in a model taking `context`
    tokens (None: no limit known).  Raises ValueError when no prompt fits."""
    if context is None:
        return None
    if response_tokens >= context:
        raise ValueError(f"{what}: {response_tokens} response tokens leave no room for a prompt in the model's "
                         f"{context} positions")
    return context - response_tokens


def drop_long_prompts(loaded: LoadResult, tokenizer, template: str | Prompt, max_prompt_tokens: int | None,
                      what: str, chunk_size: int = 1024, *, lengths: list[int] | None = None) -> LoadResult:
    """`loaded` without the examples whose prompt (the question in `template`, tokenised as the
    engines receive it; or `lengths`, each example's prompt tokens as measured elsewhere, e.g. an
    environment's whole opening) is longer than `max_prompt_tokens`: they are counted under
    `skipped["prompt_too_long"]` and summarised in one warning, like broken rows.  A prompt too
    long for the model would otherwise fail the step or evaluation that draws it."""
    if max_prompt_tokens is None or not loaded.examples:
        return loaded
    if lengths is None:
        prompt = template if isinstance(template, Prompt) else Prompt(template)
        lengths = [len(p) for lo in range(0, len(loaded.examples), chunk_size)
                   for p in prompt.encode([ex.question for ex in loaded.examples[lo:lo + chunk_size]], tokenizer)]
    kept = [ex for ex, n in zip(loaded.examples, lengths, strict=True) if n <= max_prompt_tokens]
    dropped = len(loaded.examples) - len(kept)
    if not dropped:
        return loaded
    skipped = dict(loaded.skipped)
    skipped[SKIP_PROMPT_TOO_LONG] = skipped.get(SKIP_PROMPT_TOO_LONG, 0) + dropped
    logger.warning("%s: skipped %d rows whose prompt is longer than %d tokens (%s); kept %d",
                   what, dropped, max_prompt_tokens, SKIP_PROMPT_TOO_LONG, len(kept))
    return LoadResult(kept, skipped)
