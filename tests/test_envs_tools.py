"""Tools as units (rlft/envs/tools.py, rlft/envs/tool_environment.py): a typed, documented Python function
becomes a tool with its JSON schema; one that cannot be described is refused in one line, at load and
with exit 2 from the command line; calls are dispatched by name within the tool's time and size limits;
and a throwaway tool defined here runs through an episode on the HF engine with a tiny model."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from rlft.config import ConfigError, load_config
from rlft.data.prompts import Prompt
from rlft.envs.calculator import CALCULATOR_TOOL
from rlft.envs.registry import make_environment
from rlft.envs.tool_calls import ToolCall
from rlft.envs.tool_environment import ToolEnvironment
from rlft.envs.tools import Tool, ToolError, ToolSpecError, run_tool_call, tool_from_function

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "launch" / "configs" / "grpo_cpu_tiny.yaml"
CHAT = ["data.prompt_template=chat", "data.source=tests/fixtures/gsm8k"]


def word_length(word: str, times: int = 1) -> int:
    """How many letters a word has.

    Args:
        word: the word, e.g. apple
        times: how many copies of the word to count
    """
    return len(word) * times


def no_docstring(word: str) -> int:
    return len(word)


def untyped(word) -> int:
    """Letters.

    Args:
        word: a word
    """
    return len(word)


def set_typed(words: set[object]) -> int:
    """Distinct words.

    Args:
        words: the words
    """
    return len(words)


def test_a_typed_documented_function_is_a_tool_with_its_json_schema():
    tool = tool_from_function(word_length)
    assert tool.name == "word_length" and tool.description == "How many letters a word has."
    assert tool.parameters == {"type": "object", "required": ["word"], "properties": {
        "word": {"type": "string", "description": "the word, e.g. apple"},
        "times": {"type": "integer", "description": "how many copies of the word to count"}}}
    assert tool.spec == {"type": "function", "function": {
        "name": "word_length", "description": "How many letters a word has.", "parameters": tool.parameters,
        "return": {"type": "integer"}}}


@pytest.mark.parametrize("fn, message", [
    (no_docstring, "tool no_docstring: has no docstring, which must say what it does (and its Args:)"),
    (untyped, "tool untyped: cannot be described (Argument word is missing a type hint in function untyped)"),
    (set_typed, "tool set_typed: cannot be described (Couldn't parse this type hint, likely due to a custom class "
                "or object: set[object])"),
    (lambda *words: 1, "tool <lambda>: *words cannot be described; name every argument"),
    (len, "tool len: not a Python function"),
])
def test_a_function_that_cannot_be_described_is_refused_in_one_line(fn, message):
    with pytest.raises(ToolSpecError) as err:
        tool_from_function(fn)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_calls_are_dispatched_by_name_and_checked_against_the_schema():
    def fail(word: str) -> str:
        """Fails.

        Args:
            word: anything
        """
        if word == "refuse":
            raise ToolError("not this word")
        raise KeyError(word)

    tools = {t.name: t for t in (tool_from_function(word_length), tool_from_function(fail))}

    def call(name, arguments):
        return run_tool_call(tools, ToolCall(name, arguments))

    assert call("word_length", {"word": "apple"}) == ("5", False)
    assert call("word_length", {"word": "kiwi", "times": 3}) == ("12", False)
    assert call("word_length", {}) == ("Error: missing argument 'word'", True)
    assert call("word_length", {"word": "a", "colour": 1}) == (
        "Error: unexpected arguments 'colour': the arguments are 'word', 'times'", True)
    assert call("word_length", {"word": 7}) == ("Error: argument 'word' must be string, got int", True)
    assert call("word_length", {"word": "a", "times": True}) == (
        "Error: argument 'times' must be integer, got bool", True)
    assert call("search", {"q": "x"}) == ("Error: unknown tool 'search': the tools are 'word_length', 'fail'", True)
    assert call("fail", {"word": "refuse"}) == ("Error: not this word", True)
    assert call("fail", {"word": "boom"}) == ("Error: KeyError: 'boom'", True)
    assert run_tool_call(tools, ToolCall(error="the tool call is not valid JSON (x)")) == (
        "Error: the tool call is not valid JSON (x)", True)


def test_a_call_is_bounded_in_time_and_its_reply_in_size():
    slow = Tool("slow", "sleeps", {"type": "object", "properties": {}}, lambda: time.sleep(5), time_limit_s=0.2)
    start = time.perf_counter()
    assert run_tool_call({"slow": slow}, ToolCall("slow", {})) == ("Error: the tool 'slow' took longer than 0.2 s", True)
    assert time.perf_counter() - start < 1.0
    big = Tool("big", "a long reply", {"type": "object", "properties": {}}, lambda: {"x": "y" * 100}, max_reply_chars=20)
    assert run_tool_call({"big": big}, ToolCall("big", {})) == (
        '{"x": "yyyyyyyyyyyyy ... (cut at 20 characters)', False)


def test_the_tools_environment_offers_its_tools_and_answers_each_call():
    env = ToolEnvironment(Prompt("chat"), ["calculator", word_length])
    start = env.open("How long is 'apple', twice?", "10")
    assert start.tools == (CALCULATOR_TOOL, tool_from_function(word_length).spec)
    turn = ('<tool_call>{"name": "word_length", "arguments": {"word": "apple", "times": 2}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "5 * 2"}}</tool_call>'
            '<tool_call>{"name": "shout", "arguments": {}}</tool_call>')
    result = env.step(start.state, turn)
    assert result.messages == (
        {"role": "tool", "name": "word_length", "content": "10"}, {"role": "tool", "name": "calculator", "content": "10"},
        {"role": "tool", "content": "Error: unknown tool 'shout': the tools are 'calculator', 'word_length'"})
    assert (result.tool_calls, result.tool_errors) == (3, 1) and env.step(start.state, "\\boxed{10}").done
    with pytest.raises(ValueError, match="tool 'calculator' is offered twice"):
        ToolEnvironment(Prompt("chat"), ["calculator", "calculator"])
    with pytest.raises(ValueError, match="needs at least one tool"):
        ToolEnvironment(Prompt("chat"))


USER_TOOLS = '''
def word_length(word: str) -> int:
    """How many letters a word has.

    Args:
        word: the word
    """
    return len(word)


def undocumented(word: str) -> int:
    return len(word)
'''


@pytest.fixture
def user_tools(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(textwrap.dedent(USER_TOOLS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_tools", None)


def test_environment_tools_are_described_at_load_or_refused_in_one_line(user_tools):
    cfg = load_config(TINY, [*CHAT, "environment.name=tools", "environment.tools=[calculator, my_tools:word_length]"])
    env = make_environment(cfg.environment.name, Prompt("chat"), cfg.environment.options, tools=cfg.environment.tools)
    assert list(env.tools) == ["calculator", "word_length"]
    calc = make_environment("calculator", Prompt("chat"), tools=["my_tools:word_length"])
    assert list(calc.tools) == ["calculator", "word_length"]  # the calculator's own tool, then the listed ones
    for overrides, message in [
        (["environment.name=tools", "environment.tools=[my_tools:undocumented]"],
         "environment.tools[0]: tool undocumented: has no docstring"),
        (["environment.name=tools", "environment.tools=[my_tools:nothing]"],
         "environment.tools[0]: tool 'my_tools:nothing': module 'my_tools' has no attribute 'nothing'"),
        (["environment.name=tools", "environment.tools=[abacus]"],
         "environment.tools[0]: tool 'abacus': no tool of that name is registered (registered: calculator"),
        (["environment.name=tools"], "environment.tools: environment 'tools' offers the tools listed there, and it "
                                     "lists none"),
        (["environment.tools=[calculator]"], "environment.tools: environment 'single_turn' takes no tools"),
        (["environment.name=calculator", "environment.tools=[calculator]"],
         "environment.tools: tool 'calculator' is offered twice"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config(TINY, [*CHAT, *overrides])
        assert str(err.value).startswith(message), (overrides, str(err.value))


def test_the_launch_refuses_an_undescribable_tool_with_exit_2(user_tools):
    code = ("from rlft.config import load_config_or_exit; load_config_or_exit("
            f"{str(TINY)!r}, {[*CHAT, 'environment.name=tools', 'environment.tools=[my_tools:undocumented]']!r})")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": f"{user_tools}:{REPO}"})
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "rlft: config error: environment.tools[0]: tool undocumented: has no docstring, which must say what it "
        "does (and its Args:)"]


def test_a_throwaway_tool_runs_through_an_episode_on_the_hf_engine(tmp_path):
    # A plain function of this test, no file of rlft touched: the model (taught the episode) calls it,
    # its reply goes in as the chat template's tokens, and the model answers.
    from test_envs_hf_episodes import PROMPT, teach
    from tiny_models import qwen_tokenizer_dir, tiny_model_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlft.engines.base import SamplingSpec
    from rlft.engines.hf_engine import HFEngine
    from rlft.envs.episodes import open_episodes, reply_token_ids, run_episodes

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    model_dir = tiny_model_dir(tmp_path / "model", family="qwen2", num_layers=2, tie_word_embeddings=False,
                               tokenizer_dir=qwen_tokenizer_dir())
    env = make_environment("tools", PROMPT, tools=[word_length])
    starts, prompt_ids = open_episodes(env, ["How many letters has apple?"], ["5"], tok)
    assert starts[0].tools == (tool_from_function(word_length).spec,)
    turn1 = tok('<tool_call>\n{"name": "word_length", "arguments": {"word": "apple"}}\n</tool_call>',
                add_special_tokens=False)["input_ids"]
    reply = reply_token_ids(tok, starts[0].messages, starts[0].tools,
                            [{"role": "tool", "name": "word_length", "content": "5"}])
    turn2 = tok("\\boxed{5}<|im_end|>", add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    teach(model, prompt_ids[0], turn1 + reply + turn2, [1] * len(turn1) + [0] * len(reply) + [1] * len(turn2))

    engine = HFEngine(model.eval(), tokenizer=tok)
    spec = SamplingSpec(n=1, temperature=0.0, max_tokens=40, stop=[], logprobs=True)
    [[r]] = run_episodes(engine, prompt_ids, starts, spec, tok, env, max_turns=3, max_episode_tokens=200)
    assert r.messages[1] == {"role": "tool", "name": "word_length", "content": "5"}  # len("apple"), by the tool
    assert "<tool_response>\n5\n</tool_response>" in r.transcript(tok)
    assert r.token_ids == turn1 + reply + turn2
    assert r.response_mask == [1] * len(turn1) + [0] * len(reply) + [1] * len(turn2)
    assert (r.num_turns, r.tool_calls, r.tool_errors, r.finish_reason) == (2, 1, 0, "eos")
