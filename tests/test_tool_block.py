"""A chat template that drops the tools it is offered (SmolLM2's) still shows them to the model: rlft writes
them into the system message, and the opening and the reply tokens of a tool episode agree; a template that
writes tools (Qwen2.5's) is given them unchanged."""
from __future__ import annotations

import pytest

from rlft.data.prompts import Prompt

# SmolLM2-135M-Instruct's chat template, as its GGUF carries it: every message verbatim, no tools.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    from tiny_models import tiny_chat_tokenizer_dir

    path = tiny_chat_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    writes = AutoTokenizer.from_pretrained(path)
    drops = AutoTokenizer.from_pretrained(path)
    drops.chat_template = PLAIN_TEMPLATE
    return writes, drops


def test_a_template_that_drops_tools_gets_them_in_the_system_message(tokenizers):
    from rlft.envs.calculator import CalculatorEnvironment
    from rlft.envs.tool_block import template_writes_tools, tools_block

    writes, drops = tokenizers
    assert template_writes_tools(writes) and not template_writes_tools(drops)
    start = CalculatorEnvironment(Prompt("chat")).open("What is 3 plus 4?", "7")
    assert start.tools, "the calculator environment offers its tool"
    text = start.render(drops)
    block = tools_block(start.tools)
    assert block in text and '"name": "calculator"' in text
    # the block closes the first system message (the environment's own, or one put first)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n") and system.endswith(block)
    assert text.count("<|im_start|>system") == 1
    # the rest is the template's own rendering of the same messages
    from rlft.envs.tool_block import template_input

    messages, tools = template_input(drops, start.messages, start.tools)
    assert tools is None and messages[1:] == list(start.messages)[1:] or messages[1:] == list(start.messages)
    assert text == drops.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_a_template_that_writes_tools_is_left_as_it_was(tokenizers):
    from rlft.envs.calculator import CalculatorEnvironment

    writes, _ = tokenizers
    start = CalculatorEnvironment(Prompt("chat")).open("What is 3 plus 4?", "7")
    expected = writes.apply_chat_template(list(start.messages), tools=list(start.tools), tokenize=False,
                                          add_generation_prompt=True)
    assert start.render(writes) == expected and "# Tools" in expected


def test_the_reply_tokens_agree_with_the_opening_under_either_template(tokenizers):
    from rlft.envs.calculator import CalculatorEnvironment
    from rlft.envs.episodes import reply_token_ids

    for tok in tokenizers:
        env = CalculatorEnvironment(Prompt("chat"))
        start = env.open("What is 3 plus 4?", "7")
        turn = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>'
        result = env.step(start.state, turn)
        assert not result.done
        history = [*start.messages, {"role": "assistant", "content": turn}]
        whole = tok.apply_chat_template(*_template(tok, [*history, *result.messages], start.tools), tokenize=False,
                                        add_generation_prompt=True)
        prompt = start.render(tok)
        reply = reply_token_ids(tok, list(start.messages), start.tools, result.messages)
        # the whole conversation is the opening, the turn, then exactly the reply tokens
        assert whole.startswith(prompt)
        assert whole[len(prompt):].startswith(turn)
        assert reply == tok(whole[len(prompt) + len(turn):], add_special_tokens=False)["input_ids"]
        assert "7" in tok.decode(reply)


def _template(tok, messages, tools):
    from rlft.envs.tool_block import template_input

    messages, tools = template_input(tok, messages, tools)
    return (messages,) if tools is None else (messages, tools)
