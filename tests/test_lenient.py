"""Strict and lenient accuracy side by side: the answer format's contract, and the last marked answer or
number anywhere in a response, graded by the same rules."""
from __future__ import annotations

import pytest

from rlft.data import Example
from rlft.reward.lenient import last_number, lenient_correct, marked_answer
from rlft.evaluate.scoring import score_responses


@pytest.mark.parametrize("response, expected", [
    ("x </think> <answer> 18 </answer>", (True, "18")),
    ("thinking <answer> 18", (True, "18")),                             # no closing tag, no </think>
    ("so \\boxed{\\frac{1}{2}} and then nothing", (True, "\\frac{1}{2}")),
    ("<answer> \\boxed{7} </answer>", (True, "7")),                     # the box inside the tags comes last
    ("\\boxed{7} ... <answer> 8 </answer>", (True, "8")),               # whichever comes last
    ("work\n#### 1,080\n", (True, "1,080")),
    ("#### 3 then \\boxed{4}", (True, "4")),
    ("no marker, just 42", (False, None)),
    ("<answer>   </answer>", (False, None)),
])
def test_marked_answer(response, expected):
    assert marked_answer(response) == expected


@pytest.mark.parametrize("response, expected", [
    ("so she has 18 apples.", (True, "18")),
    ("It costs $1,234.50 in all", (True, "1,234.50")),
    ("x = -3", (True, "-3")),
    ("5-3", (True, "3")),                      # subtraction, not a negative number
    ("half: \\frac{1}{2}", (True, "\\frac{1}{2}")),  # a fraction is one number, not its denominator
    ("a share of 3/4.", (True, "3/4")),
    ("it is .5", (True, ".5")),
    ("no digits here", (False, None)),
])
def test_last_number(response, expected):
    assert last_number(response) == expected


def test_lenient_is_strict_or_a_lenient_reading_graded_the_same_way():
    from rlft.reward.grader import grade_batch

    responses = [
        " x </think> <answer> 18 </answer>",          # right both ways
        " the answer is 18",                         # no tags: strictly nothing; its last number is right
        " x </think> <answer> eighteen </answer>",   # words are no number, either way
        " 18 or maybe 20",                           # lenient reads its last number: 20
        " x </think> <answer> 36/2 </answer>",       # arithmetic left undone stays wrong
        " so x = \\frac{1}{2}",                      # a MATH gold, through the same number rules
        " x </think> <answer> 7 </answer>",          # well-formed, wrong
    ]
    golds = ["18", "18", "18", "18", "18", "0.5", "18"]
    strict = grade_batch(responses, golds)
    assert [g["answer_reward"] for g in strict] == [1, 0, 0, 0, 0, 0, 0]
    assert lenient_correct(responses, golds, strict) == [True, True, False, False, False, True, False]


def test_score_responses_reports_strict_and_lenient_side_by_side():
    def example(i, truth):
        return Example(question=f"q{i}", ground_truth=truth, solution=None, source="test", index=i)

    exs = [example(0, "72"), example(1, "10"), example(2, "\\frac{3}{4}")]
    responses = [[" ok </think> <answer> 72 </answer>", " she sold 72 clips"],      # strict 1 0, lenient 1 1
                 [" hmm </think> <answer> 12 </answer>", " so \\boxed{10}"],         # strict 0 0, lenient 0 1
                 [" x </think> <answer> 0.75 </answer>", " it is 3/4 of the cake"]]  # strict 1 0, lenient 1 1
    records, summary = score_responses(exs, responses, [[1, 2], [3, 4], [5, 6]], k=2)
    # The existing numbers keep their meaning: the format's contract.
    assert summary["accuracy"] == pytest.approx(2 / 6) and summary["format_rate"] == pytest.approx(3 / 6)
    assert summary["pass@k"] == pytest.approx(2 / 3)
    # Beside them: right strictly or by the last marked answer / number.
    assert summary["accuracy_lenient"] == pytest.approx(5 / 6)
    assert summary["pass@k_lenient"] == pytest.approx(1.0)
    assert [r["answer_rewards_lenient"] for r in records] == [[1.0, 1.0], [0.0, 1.0], [1.0, 1.0]]
    assert [r["num_correct_lenient"] for r in records] == [2, 1, 2]
    assert [r["answer_reward_lenient"] for r in records] == [1.0, 0.0, 1.0]
    assert [r["answer_rewards"] for r in records] == [[1.0, 0.0], [0.0, 0.0], [1.0, 0.0]]


def test_the_evaluation_table_shows_both():
    from rlft.evaluate.cli import format_summary

    table = format_summary({"num_examples": 3, "num_samples": 2, "k": 2, "accuracy": 0.25, "pass@k": 0.5,
                            "accuracy_lenient": 0.75, "pass@k_lenient": 1.0, "format_rate": 0.5,
                            "mean_reward": 0.25, "mean_response_length": 3.0})
    lines = [" ".join(line.split()) for line in table.splitlines()]
    assert lines[2:6] == ["accuracy (pass@1) 0.2500", "pass@2 0.5000", "lenient accuracy 0.7500",
                          "lenient pass@2 1.0000"]
