"""Bounds on a user's environment (rlft/envs/guard.py): a call that never returns, or a reply of megabytes,
stops the run with one line naming the environment, the question and the rank, instead of freezing it."""
from __future__ import annotations

import copy
import textwrap
import time

import pytest

from rlft.data.prompts import Prompt
from rlft.envs.base import StepResult
from rlft.envs.guard import EnvironmentCallError, set_default_limits
from rlft.envs.registry import EnvironmentSpecError, make_environment

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"

MODULE = '''
import threading
from rlft.envs.base import Environment, EpisodeStart, StepResult

class Slow(Environment):
    """Hangs in step() when the turn asks it to, in open() on a question with 'hang'."""
    stop = ("</ask>",)

    def __init__(self, prompt=None, reply_chars=2, hang_build=False, opening_chars=0):
        super().__init__(prompt)
        if hang_build:
            threading.Event().wait()
        self.reply_chars, self.opening_chars = reply_chars, opening_chars

    def open(self, question, ground_truth):
        if "hang" in question:
            threading.Event().wait()
        pad = [{"role": "system", "content": "y" * self.opening_chars}] if self.opening_chars else []
        return EpisodeStart(messages=(*pad, *self.prompt.chat_messages(question)), state={"turns": 0})

    def step(self, state, text):
        if state is not None:
            state["turns"] += 1
        if "hang" in text:
            threading.Event().wait()
        if "big" in text:
            return StepResult.reply([{"role": "tool", "content": "x" * self.reply_chars}], tool_calls=1)
        return StepResult.end(reward=1.0)
'''


@pytest.fixture
def slow_env(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "rlft_test_guard_envs.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.setenv("RANK", "3")
    set_default_limits(0.5, 1000)
    yield "rlft_test_guard_envs:Slow"
    set_default_limits(60.0, 100_000)


def test_a_step_that_never_returns_fails_in_time_naming_environment_question_and_rank(slow_env):
    env = make_environment(slow_env, Prompt("chat"))
    start = env.open(QUESTION, "7")
    state = copy.deepcopy(start.state)  # as the rollout does, per episode
    assert state == {"turns": 0} and type(env).__name__ == "Slow"
    t0 = time.monotonic()
    with pytest.raises(EnvironmentCallError) as info:
        env.step(state, "please hang</ask>")
    assert time.monotonic() - t0 < 5
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"environment '{slow_env}' step() (question 'Tom has 3 apples and buys 4 more.")
    assert "rank 3" in message and "did not return within 0.5 s" in message
    assert "environment.step_timeout_s" in message
    assert env.step(copy.deepcopy(start.state), "fine") == StepResult.end(reward=1.0)


def test_a_step_on_a_state_that_cannot_carry_the_question_names_the_drivers(slow_env):
    # A state of None (a single-turn environment's) carries nothing: the rollout driver names the episode's
    # question around each step (rlft.envs.episodes), and the message quotes it, cut to 80 characters.
    from rlft.envs.guard import asking

    env = make_environment(slow_env, Prompt("chat"))
    long_question = QUESTION + " " + "And then? " * 10
    with asking(long_question), pytest.raises(EnvironmentCallError) as info:
        env.step(None, "hang</ask>")
    assert f"step() (question '{long_question[:80]}...', rank 3) did not return within 0.5 s" in str(info.value)
    with pytest.raises(EnvironmentCallError, match=r"step\(\) \(question unknown, rank 3\)"):
        env.step(None, "hang</ask>")


def test_an_open_that_never_returns_fails_in_time(slow_env):
    env = make_environment(slow_env, Prompt("chat"))
    with pytest.raises(EnvironmentCallError, match=r"open\(\) \(question 'hang here', rank 3\) did not return"):
        env.open("hang here", "7")


def test_a_constructor_that_never_returns_is_refused_at_start(slow_env):
    with pytest.raises(EnvironmentSpecError, match="could not be built .*did not return within 0.5 s"):
        make_environment(slow_env, Prompt("chat"), {"hang_build": True})


def test_a_reply_past_the_cap_is_refused_before_tokenising(slow_env):
    env = make_environment(slow_env, Prompt("chat"), {"reply_chars": 1000})
    start = env.open(QUESTION, "7")
    assert env.step(copy.deepcopy(start.state), "big</ask>").messages[0]["content"] == "x" * 1000
    env = make_environment(slow_env, Prompt("chat"), {"reply_chars": 10_000_000})
    t0 = time.monotonic()
    with pytest.raises(EnvironmentCallError, match=r"replied 10000000 characters, more than "
                                                   r"environment.max_reply_chars=1000"):
        env.step(copy.deepcopy(start.state), "big</ask>")
    assert time.monotonic() - t0 < 5


def test_an_opening_is_capped_on_what_the_environment_writes_not_on_the_question(slow_env):
    # A question longer than the cap is the data's (a too-long prompt is skipped and counted, not refused).
    long_question = "How many apples? " * 200  # 3400 characters, past the cap of 1000
    start = make_environment(slow_env, Prompt("chat")).open(long_question, "7")
    assert long_question in start.messages[-1]["content"]
    # What the environment writes around it is capped: refused at build, by the probe episode.
    with pytest.raises(EnvironmentSpecError, match=r"open\(\) .*replied 51\d\d characters, more than "
                                                   r"environment.max_reply_chars=1000"):
        make_environment(slow_env, Prompt("chat"), {"opening_chars": 5000})


def test_the_config_keys_are_checked():
    from rlft.config import ConfigError, load_config

    cfg = load_config(None, [])
    assert (cfg.environment.step_timeout_s, cfg.environment.max_reply_chars) == (60.0, 100_000)
    with pytest.raises(ConfigError, match="environment.step_timeout_s: must be > 0"):
        load_config(None, ["environment.step_timeout_s=0"])


def test_the_evaluation_takes_the_configs_bounds(slow_env):
    # python -m rlft.evaluate --config: the environment is bounded by the config's environment.step_timeout_s.
    import argparse

    from rlft.config import load_config
    from rlft.evaluate.cli import InputError, build_environment

    set_default_limits(60.0, 100_000)
    cfg = load_config(None, [f"environment.name={slow_env}", "environment.step_timeout_s=0.3",
                             "environment.max_reply_chars=1000"])
    args = argparse.Namespace(no_tools=False, environment=None, run_config=cfg, prompt=Prompt("chat"))
    env, _ = build_environment(args)
    assert env.guard_limits.step_timeout_s == 0.3 and env.guard_limits.max_reply_chars == 1000
    start = env.open(QUESTION, "7")
    with pytest.raises(EnvironmentCallError, match="did not return within 0.3 s"):
        env.step(copy.deepcopy(start.state), "hang</ask>")
    args.run_config = load_config(None, [f"environment.name={slow_env}", "environment.options={hang_build: true}",
                                         "environment.step_timeout_s=0.3"])
    with pytest.raises(InputError, match="could not be built .*did not return within 0.3 s"):
        build_environment(args)
