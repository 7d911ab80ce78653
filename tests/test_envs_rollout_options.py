"""Tool episodes' rollout options (rlft/envs/rollout_options.py, rlft/envs/demonstrations.py) and their
diagnostics (rlft/envs/turns.py, rlft/envs/metrics.py), on hand-built episodes with hand-computed figures:
void-turn filtering, the capped well-formed-call reward, demonstrations annealed to none."""
from __future__ import annotations

import pytest
import torch

from rlft.data.prompts import Prompt
from rlft.envs.episodes import EpisodeResult
from rlft.envs.metrics import episode_metrics
from rlft.envs.rollout_options import add_tool_reward, demonstration_share, mask_void_episodes, void_episode_rows
from rlft.envs.turns import call_counts, is_void_turn

CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
BAD_CALL = '<tool_call>\n{"name": "calculator", "arguments": 48}\n</tool_call>'  # arguments not an object
BOXED = Prompt("chat", answer_format="boxed")


def episode(turns: list[str], tool_calls: int = 0, tool_errors: int = 0) -> EpisodeResult:
    return EpisodeResult(token_ids=[1] * 4, response_mask=[1] * 4, text=turns[-1], turns=turns, num_turns=len(turns),
                         tool_calls=tool_calls, tool_errors=tool_errors, finish_reason="eos")


# A: a well-formed call, then the boxed answer.  B: a malformed call, then a turn without an answer (void).
# C: the boxed answer at once.  D: a turn cut before any call or answer (void).  E: two well-formed calls.
# F: one well-formed call and one malformed.
A = episode([CALL.format("48 / 2"), "So \\boxed{24}"], tool_calls=1)
B = episode([BAD_CALL, "I think it is 24"], tool_calls=1, tool_errors=1)
C = episode(["\\boxed{7}"])
D = episode(["Let me compute 48 / 2 and then"])
E = episode([CALL.format("1 + 1") + CALL.format("2 + 2"), "\\boxed{5}"], tool_calls=2)
F = episode([CALL.format("3 * 3") + BAD_CALL, "\\boxed{9}"], tool_calls=2, tool_errors=1)


def test_turns_are_calls_answers_or_void():
    assert not is_void_turn(CALL.format("1"), "boxed") and not is_void_turn(BAD_CALL, "boxed")  # calls
    assert not is_void_turn("so \\boxed{3}", "boxed") and is_void_turn("so 3", "boxed")
    assert not is_void_turn("#### 3", "gsm8k") and is_void_turn("\\boxed{3}", "gsm8k")  # the run's format decides
    assert [call_counts(e.turns) for e in (A, B, C, D, E, F)] == [(1, 1), (0, 1), (0, 0), (0, 0), (2, 2), (1, 2)]


def test_episode_metrics_count_calls_well_formed_calls_and_void_turns():
    m = episode_metrics([A, B, C, D], correct=[1.0, 0.0, 1.0, 0.0], answer_format="boxed")
    assert m["episodes/with_tool_call"] == 0.5  # the call rate: A and B
    assert m["episodes/well_formed_rate"] == 0.5  # A's call of A's and B's two
    assert m["episodes/tool_error_rate"] == 0.5  # B's one error in two calls
    assert m["episodes/void_turn_rate"] == 0.5  # B and D
    assert m["episodes/turns"] == 1.5  # (2 + 2 + 1 + 1) / 4
    assert m["episodes/accuracy_with_tool"] == 0.5 and m["episodes/accuracy_without_tool"] == 0.5
    # Without calls there is no well-formed rate; without an answer format, no void-turn rate.
    plain = episode_metrics([C, D])
    assert "episodes/well_formed_rate" not in plain and "episodes/void_turn_rate" not in plain


def test_void_turn_filtering_masks_exactly_the_episodes_with_a_void_turn():
    class Batch:
        response_mask = torch.ones(5, 3)

    episodes = [A, B, None, D, C]  # None: a single-turn row, never void
    assert void_episode_rows(episodes, "boxed") == [1, 3]
    batch = Batch()
    assert mask_void_episodes("filter", batch, episodes, "boxed") == {"void_turns/masked": 2.0}
    assert batch.response_mask.sum(-1).tolist() == [3.0, 0.0, 3.0, 0.0, 3.0]
    kept = Batch()
    kept.response_mask = torch.ones(5, 3)
    assert mask_void_episodes("keep", kept, episodes, "boxed") == {} and kept.response_mask.sum() == 15


class RewardSection:
    def __init__(self, mode: str, weight: float):
        self.tool_reward, self.tool_reward_weight = mode, weight


@pytest.mark.parametrize("weight", [0.1, 0.99])
def test_the_well_formed_call_reward_never_lifts_a_wrong_answer_over_a_correct_one(weight):
    # The built-in grader: 1 for a correct answer, 0 for a wrong one (format_weight 0).
    episodes = [A, B, C, E, F, None]
    grades = [{"reward": r} for r in (1.0, 0.0, 1.0, 0.0, 1.0, 1.0)]
    add_tool_reward(RewardSection("well_formed_calls", weight), grades, episodes)
    # A: 1 of 1 call well-formed; B: 0 of 1; C: no call; E: 2 of 2 (wrong answer); F: 1 of 2; None: single turn.
    assert [g["reward"] for g in grades] == pytest.approx([1 + weight, 0.0, 1.0, weight, 1 + weight / 2, 1.0])
    assert [g.get("tool_reward") for g in grades] == pytest.approx([weight, 0.0, 0.0, weight, weight / 2, None])
    correct = [g["reward"] for g, r in zip(grades, (1, 0, 1, 0, 1, 1)) if r]
    wrong = [g["reward"] for g, r in zip(grades, (1, 0, 1, 0, 1, 1)) if not r]
    assert min(correct) > max(wrong)
    untouched = [{"reward": 0.0}]
    add_tool_reward(RewardSection("none", weight), untouched, [E])
    assert untouched == [{"reward": 0.0}]


def test_demonstrations_anneal_from_every_prompt_to_none():
    assert [demonstration_share("annealed", 4, s) for s in (1, 2, 3, 5, 100)] == [1.0, 0.75, 0.5, 0.0, 0.0]
    assert demonstration_share("none", 4, 1) == 0.0


def test_a_demonstration_is_a_worked_episode_of_the_environment_before_the_question():
    from transformers import AutoTokenizer

    from rlft.config import load_config
    from rlft.envs.demonstrations import DEMO_QUESTION, DemonstratedEnvironment, demonstration_step, with_demonstrations
    from rlft.envs.registry import make_environment
    from tiny_models import qwen_tokenizer_dir

    calculator = make_environment("calculator", BOXED)
    cfg = load_config(None, ["environment.name=calculator", "data.prompt_template=chat", "reward.answer_format=boxed",
                             "environment.demonstrations=annealed", "environment.demonstration_steps=4"])
    env = with_demonstrations(calculator, cfg)
    assert isinstance(env, DemonstratedEnvironment) and env.stop == calculator.stop and env.multi_turn
    instruction = "Please reason step by step, and put your final answer within \\boxed{}."
    assert env.demonstration == [
        {"role": "user", "content": f"{DEMO_QUESTION}\n{instruction}"},
        {"role": "assistant", "content": "Natalia sold 48/2 =\n" + CALL.format("48/2")},
        {"role": "tool", "content": "24"},
        {"role": "assistant", "content": "24 clips in May.\nNatalia sold 48+24 =\n" + CALL.format("48+24")},
        {"role": "tool", "content": "72"},
        {"role": "assistant", "content": "72 clips altogether in April and May.\nThe final answer is $\\boxed{72}$."},
    ]
    questions = [f"What is {i} plus {i + 1}?" for i in range(200)]
    assert demonstration_step(env, 1) == {"episodes/demonstration_share": 1.0}
    opened = [env.open(q, "0") for q in questions]
    assert all(s.messages[:-1] == tuple(env.demonstration) and s.tools == calculator.open("q", "0").tools
               for s in opened)
    assert demonstration_step(env, 3) == {"episodes/demonstration_share": 0.5}
    shown = [len(env.open(q, "0").messages) > 1 for q in questions]
    assert 70 < sum(shown) < 130 and shown == [len(env.open(q, "0").messages) > 1 for q in questions]
    demonstration_step(env, 5)
    assert all(env.open(q, "0") == calculator.open(q, "0") for q in questions)
    assert demonstration_step(calculator, 1) == {} and with_demonstrations(calculator, load_config(None, [])) is calculator
    # Qwen2.5's template writes the demonstration as a conversation, the tool's replies as tool responses.
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    demonstration_step(env, 1)
    text = env.open(questions[0], "7").render(tok)
    assert text.index("<tool_response>\n24\n</tool_response>") < text.index("$\\boxed{72}$") < text.index(questions[0])


@pytest.mark.parametrize("overrides, message", [
    (["environment.void_turns=filter"], "environment.void_turns: applies to tool episodes"),
    (["reward.tool_reward=well_formed_calls"], "reward.tool_reward: applies to tool episodes"),
    (["environment.demonstrations=annealed"], "environment.demonstrations: applies to tool episodes"),
    (["environment.void_turns=drop"], "environment.void_turns: must be one of keep, filter"),
    (["reward.tool_reward_weight=1.0"], r"reward.tool_reward_weight: must be in \[0, 1\)"),
    (["environment.demonstration_steps=0"], "environment.demonstration_steps: must be >= 1"),
    (["environment.name=calculator", "data.prompt_template=chat", "reward.tool_reward=well_formed_calls",
      "reward.fn=operator:add"], "reward.tool_reward: the cap below a correct answer"),
])
def test_rollout_options_are_checked_before_any_rank_starts(overrides, message):
    from rlft.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
