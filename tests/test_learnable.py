"""Runs that would exit 0 having learnt nothing are refused before any rank starts (rlft/config/learnable.py,
through rlft.config.launch_plan): a reward.fn that cannot tell a right answer from a wrong one, and a token
budget that cannot hold any answer."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from test_preflight import GSM8K, accepted, fake_model, refusal

REWARDS = '''
import threading
import time

def never(response, ground_truth):
    threading.Event().wait()

def constant(response, ground_truth):
    return 1.0

def always_raises(response, ground_truth):
    raise KeyError("answer")

def slow(response, ground_truth):
    time.sleep(0.3)
    return float(ground_truth in response)

def right(response, ground_truth):
    return float("<answer> " + ground_truth + " </answer>" in response)
'''


@pytest.fixture
def common(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "rlft_test_rewards.py").write_text(textwrap.dedent(REWARDS))
    model = fake_model(tmp_path / "model")
    return [f"output.dir={tmp_path / 'out'}", f"model.path={model}", f"data.source={GSM8K}"]


def test_a_reward_fn_that_cannot_tell_right_from_wrong(common, capsys):
    # The question quoted to 80 characters, with the function's module:name.
    row = "on the training question 'Natalia sold clips to 48 of her friends in April, and then she sold half as many...' (gold '72')"
    assert refusal(capsys, *common, "reward.fn=rlft_test_rewards:constant") == (
        f"reward.fn: rlft_test_rewards:constant gives the right answer '72' and a wrong one '73' the same reward (1) "
        f"{row}: no group would have an advantage to learn from")
    assert refusal(capsys, *common, "reward.fn=rlft_test_rewards:always_raises") == (
        f"reward.fn: rlft_test_rewards:always_raises raised KeyError: 'answer' {row} with the right answer '72'; "
        f"every rollout would score 0")
    assert refusal(capsys, *common, "reward.fn=rlft_test_rewards:slow", "reward.timeout_s=0.1").startswith(
        "reward.fn: rlft_test_rewards:slow took 0.3 s for one response, more than reward.timeout_s (0.1)")
    accepted(capsys, *common, "reward.fn=rlft_test_rewards:right")
    accepted(capsys, *common, "reward.fn=rlft_test_rewards:slow")


def test_a_reward_fn_that_never_returns_is_refused_within_the_probes_deadline(common, capsys, monkeypatch):
    import time

    from rlft.config import learnable

    monkeypatch.setattr(learnable, "PROBE_DEADLINE_S", 0.5)
    t0 = time.monotonic()
    assert refusal(capsys, *common, "reward.fn=rlft_test_rewards:never") == (
        "reward.fn: rlft_test_rewards:never did not return within 1 s on the training question 'Natalia sold clips "
        "to 48 of her friends in April, and then she sold half as many...' (gold '72')")
    assert time.monotonic() - t0 < 10


def test_a_token_budget_that_cannot_hold_an_answer(tmp_path, common, capsys):
    from tiny_models import qwen_tokenizer_dir

    assert refusal(capsys, *common, "sampling.max_tokens=4") == (
        "sampling.max_tokens: 4 tokens cannot hold an answer: the shortest well-formed answer of reward.answer_format "
        "r1_tags, '</think> <answer>7</answer>', takes at least 6 tokens; every response would be cut before its "
        "answer and score 0")
    accepted(capsys, *common, "sampling.max_tokens=6")
    assert refusal(capsys, *common, "sampling.eval_max_tokens=5").startswith(
        "sampling.eval_max_tokens: 5 tokens cannot hold an answer")
    qwen = Path(qwen_tokenizer_dir())
    model = fake_model(tmp_path / "qwen")
    (model / "tokenizer.json").write_bytes((qwen / "tokenizer.json").read_bytes())
    with_tokenizer = [common[0], f"model.path={model}", *common[2:]]
    assert refusal(capsys, *with_tokenizer, "sampling.max_tokens=7").startswith(
        "sampling.max_tokens: 7 tokens cannot hold an answer: the shortest well-formed answer of reward.answer_format "
        "r1_tags, '</think> <answer>7</answer>', takes 8 tokens with the model's tokenizer")  # </think>, Ġ<, answer, >, 7, </, answer, >
    assert refusal(capsys, *with_tokenizer, "sampling.max_tokens=4", "reward.answer_format=boxed",
                   "data.prompt_template=r1_short").startswith(
        "sampling.max_tokens: 4 tokens cannot hold an answer: the shortest well-formed answer of reward.answer_format "
        "boxed, '\\\\boxed{7}', takes 5 tokens")
    accepted(capsys, *with_tokenizer, "sampling.max_tokens=5", "reward.answer_format=boxed", "data.prompt_template=r1_short")
    tools = [*with_tokenizer, "environment.name=calculator", "data.prompt_template=chat",
             "sampling.max_tokens=64", "reward.answer_format=boxed"]
    (model / "tokenizer_config.json").write_text('{"chat_template": "{{ messages[0].content }}"}')
    assert refusal(capsys, *tools, "environment.max_episode_tokens=3").startswith(
        "environment.max_episode_tokens: 3 tokens cannot hold an answer")


def test_a_text_prompt_asking_for_another_answer_format(common, capsys):
    # r1_zero asks for <answer> </answer>; graded as boxed, no response could score (before: exit 0, reward 0).
    assert refusal(capsys, *common, "reward.answer_format=boxed") == (
        "data.prompt_template: r1_zero asks for answers as r1_tags (</answer>), but reward.answer_format boxed grades "
        "another (the last \\boxed{...} holds the final answer): every response would score 0; set reward.answer_format=r1_tags, "
        "or a template asking for boxed (data.prompt_template=chat adds its instruction)")
    assert refusal(capsys, *common, "reward.answer_format=gsm8k", "data.prompt_template=question_only").startswith(
        "data.prompt_template: question_only asks for answers as r1_tags (</answer>), but reward.answer_format gsm8k")
    accepted(capsys, *common, "reward.answer_format=boxed", "data.prompt_template=r1_short")  # names no format
    accepted(capsys, *common, "reward.answer_format=boxed",
             "data.prompt_template=Put the answer in \\boxed{} or <answer></answer>: {question}")
