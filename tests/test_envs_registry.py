"""Environments by name (rlft/envs/registry.py): the built-in records, a user's own `module:Class`, and
every way a broken one is refused at start with one line naming the problem."""
from __future__ import annotations

import textwrap

import pytest

from rlft.envs.base import EpisodeStart, SingleTurnEnvironment, StepResult
from rlft.envs.calculator import CALCULATOR_TOOL, CalculatorEnvironment
from rlft.envs.registry import (
    ENVIRONMENTS,
    EnvironmentRecord,
    EnvironmentSpecError,
    environment_record,
    make_environment,
    register_environment,
)
from rlft.data.prompts import Prompt

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    from tiny_models import qwen_tokenizer_dir

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


def test_the_built_in_records():
    assert ENVIRONMENTS["single_turn"].multi_turn is False and ENVIRONMENTS["single_turn"].needs_chat is False
    assert ENVIRONMENTS["calculator"].multi_turn is True and ENVIRONMENTS["calculator"].needs_chat is True
    assert isinstance(make_environment("calculator", Prompt("chat")), CalculatorEnvironment)
    with pytest.raises(ValueError, match="already registered"):
        register_environment(EnvironmentRecord("calculator", CalculatorEnvironment, multi_turn=True))


def test_single_turn_opens_todays_prompt():
    text = make_environment("single_turn", Prompt("r1_zero"))
    assert text.open(QUESTION, "7") == EpisodeStart(text=Prompt("r1_zero").render(QUESTION))
    chat = make_environment(prompt=Prompt("chat", system="Be brief.", answer_format="boxed"))
    assert isinstance(chat, SingleTurnEnvironment)
    start = chat.open(QUESTION, "7")
    assert list(start.messages) == Prompt("chat", system="Be brief.", answer_format="boxed").chat_messages(QUESTION)
    assert start.tools is None and chat.step(None, "\\boxed{7}") == StepResult.end()


def test_single_turn_prompt_ids_are_the_prompts(qwen_tokenizer):
    for prompt in (Prompt("chat", answer_format="boxed"), Prompt("r1_zero")):
        env = make_environment("single_turn", prompt)
        assert env.open(QUESTION, "7").token_ids(qwen_tokenizer) == prompt.encode([QUESTION], qwen_tokenizer)[0]


def test_calculator_prompt_offers_the_tool_through_the_template(qwen_tokenizer):
    start = make_environment("calculator", Prompt("chat", answer_format="boxed")).open(QUESTION, "7")
    text = start.render(qwen_tokenizer)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '"name": "calculator"' in text and text.endswith(QUESTION + "\nPlease reason step by step, and put "
                                                           "your final answer within \\boxed{}.<|im_end|>\n"
                                                           "<|im_start|>assistant\n")
    assert start.tools == (CALCULATOR_TOOL,)


GOOD_MODULE = '''
from rlft.envs.base import Environment, EpisodeStart, StepResult

class Echo(Environment):
    """Answers the first turn with a fixed reply, then ends."""

    stop = ("</ask>",)

    def __init__(self, prompt, reply="ok"):
        super().__init__(prompt)
        self.reply = reply

    def open(self, question, ground_truth):
        return EpisodeStart(messages=tuple(self.prompt.chat_messages(question)), state={"turns": 0})

    def step(self, state, text):
        state["turns"] += 1
        if state["turns"] > 1:
            return StepResult.end(reward=1.0)
        return StepResult.reply([{"role": "tool", "content": self.reply}], tool_calls=1)

class Outer:
    Inner = Echo
'''


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """Writes modules into a directory on sys.path: write(name, source)."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    return write


def test_a_users_class_is_loaded_checked_and_built_with_its_options(user_modules):
    module = user_modules("rlft_test_envs_good", GOOD_MODULE)
    record = environment_record(f"{module}:Echo")
    assert (record.name, record.multi_turn, record.needs_chat) == (f"{module}:Echo", True, False)
    assert record.description == "Answers the first turn with a fixed reply, then ends."
    env = make_environment(f"{module}:Echo", Prompt("chat"), {"reply": "pong"})
    start = env.open(QUESTION, "7")
    first = env.step(start.state, "x</ask>")
    assert first.messages == ({"role": "tool", "content": "pong"},) and not first.done
    assert env.step(start.state, "y") == StepResult.end(reward=1.0)
    assert type(make_environment(f"{module}:Outer.Inner", Prompt("chat"))).__name__ == "Echo"


BROKEN = {
    "import_error": ("import json\nraise RuntimeError('no backend here\\nsecond line')\n", "Echo",
                     "importing module '{m}' failed (RuntimeError: no backend here second line)"),
    "syntax_error": ("def broken(:\n    pass\n", "Echo", "importing module '{m}' failed (SyntaxError: "),
    "missing_class": ("X = 1\n", "Echo", "module '{m}' has no attribute 'Echo'"),
    "a_function": ("def Echo():\n    pass\n", "Echo",
                   "not a subclass of rlft.envs.base.Environment (it is a function)"),
    "other_class": ("class Echo:\n    pass\n", "Echo",
                    "not a subclass of rlft.envs.base.Environment (it is a class Echo)"),
    "abstract": ("from rlft.envs.base import Environment\nclass Echo(Environment):\n"
                 "    def open(self, question, ground_truth):\n        return None\n", "Echo",
                 "Echo does not implement step"),
    "bad_flag": (GOOD_MODULE + "\nclass Bad(Echo):\n    multi_turn = 'yes'\n", "Bad",
                 "multi_turn must be True or False, got 'yes'"),
    "bad_stop": (GOOD_MODULE + "\nclass Bad(Echo):\n    stop = '</ask>'\n", "Bad",
                 "stop must be a tuple of non-empty strings, got '</ask>'"),
    "init_fails": (GOOD_MODULE + "\nclass Bad(Echo):\n    def __init__(self, prompt):\n"
                   "        raise KeyError('needs a key')\n", "Bad", "could not be built (KeyError: 'needs a key')"),
    "open_fails": (GOOD_MODULE + "\nclass Bad(Echo):\n    def open(self, question, ground_truth):\n"
                   "        return 1 / 0\n", "Bad",
                   "open() failed on a probe question (ZeroDivisionError: division by zero)"),
    "open_returns_wrong": (GOOD_MODULE + "\nclass Bad(Echo):\n    def open(self, question, ground_truth):\n"
                           "        return {'messages': []}\n", "Bad", "open() returned a dict, not an EpisodeStart"),
    "text_but_multi_turn": (GOOD_MODULE + "\nfrom rlft.envs.base import EpisodeStart\nclass Bad(Echo):\n"
                            "    def open(self, question, ground_truth):\n        return EpisodeStart(text=question)\n",
                            "Bad", "takes several turns, which need chat messages, but open() gave a text prompt"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_users_environment_is_refused_with_one_line(user_modules, case):
    source, cls, expected = BROKEN[case]
    module = user_modules(f"rlft_test_envs_{case}", source)
    with pytest.raises(EnvironmentSpecError) as err:
        make_environment(f"{module}:{cls}", Prompt("chat"))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"environment '{module}:{cls}'")
    assert expected.format(m=module) in message, message


@pytest.mark.parametrize("name, expected", [
    ("nope", "unknown environment 'nope': use one of ['calculator', 'single_turn', 'tools'] or module:Class"),
    ("rlft_no_such_module_xyz:Env", "environment 'rlft_no_such_module_xyz:Env': cannot import module "
                                    "'rlft_no_such_module_xyz' (ModuleNotFoundError: No module named "
                                    "'rlft_no_such_module_xyz')"),
    ("json:", "environment 'json:': expected 'module:Class'"),
    (":Env", "environment ':Env': expected 'module:Class'"),
    ("", "environment must be a name or module:Class, got ''"),
])
def test_bad_names_are_refused_with_one_line(name, expected):
    with pytest.raises(EnvironmentSpecError) as err:
        make_environment(name, Prompt("chat"))
    assert str(err.value) == expected


def test_the_records_and_the_driver_load_without_torch():
    """The launch checks a config's environment before any rank starts, without loading torch."""
    import subprocess
    import sys

    code = ("import sys, rlft.envs.registry, rlft.envs.episodes, rlft.envs.metrics; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_tool_environment_needs_a_chat_prompt():
    with pytest.raises(EnvironmentSpecError, match=r"^environment 'calculator' offers tools through the chat "
                                                   r"template: use a chat prompt \(data.prompt_template: chat\)$"):
        make_environment("calculator", Prompt("r1_zero"))


def test_an_overlong_buffer_longer_than_an_episode_is_refused_in_one_line():
    from rlft.config import ConfigError, build_config

    tools = {"environment": {"name": "calculator", "max_episode_tokens": 96}, "data": {"prompt_template": "chat"},
             "sampling": {"max_tokens": 512}}
    with pytest.raises(ConfigError, match=r"^grpo.overlong_buffer: 128 tokens is more than an episode may have "
                                          r"\(environment.max_episode_tokens: 96\)$"):
        build_config({**tools, "grpo": {"overlong": "soft_penalty", "overlong_buffer": 128}})
    build_config({**tools, "grpo": {"overlong": "soft_penalty", "overlong_buffer": 96}})  # it fits
    build_config({**tools, "grpo": {"overlong": "filter", "overlong_buffer": 128}})  # no penalty, no limit
