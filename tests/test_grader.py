"""Tests for rlft.reward.grader: R1-Zero format, answer equivalence, and safety against hostile outputs."""

import os
import time
from fractions import Fraction

import pytest

from rlft.reward.worker import is_safe_for_symbolic
from rlft.reward.answers import (
    distinct_candidates,
    extract_answer_text,
    extract_boxed,
    normalize_number,
    parse_number_form,
)
from rlft.reward.grader import Grader, default_grader, grade_batch, r1_zero_reward_fn

RIGHT = {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}
WRONG = {"format_reward": 1.0, "answer_reward": 0.0, "reward": 0.0}
NO_FORMAT = {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}

HOSTILE_SECONDS = 3.0  # per-item bound is 1 s; the rest is slack for a loaded 2-core machine


def respond(answer: str) -> str:
    """A well-formed response (the prompt already ended with '<think>')."""
    return f"Let me add the numbers. </think> <answer>{answer}</answer>"


@pytest.fixture(scope="module", autouse=True)
def warm_default_grader():
    """Start the shared grader's workers once, so timing assertions measure checks, not imports."""
    default_grader().start()
    yield
    default_grader().close()


# --------------------------------------------------------------------------- right answers

RIGHT_CASES = [
    ("18", "18"),
    ("$18", "18"),
    ("\\$18", "18"),
    ("18.0", "18"),
    ("18.00", "18"),
    ("1,000", "1000"),
    ("1000", "1,000"),
    ("$1,234.50", "1234.5"),
    ("\\boxed{18}", "18"),
    ("The total is \\boxed{18}.", "18"),
    ("18 dollars", "18"),
    ("\\text{18 apples}", "18"),
    (" 18. ", "18"),
    ("**18**", "18"),
    ("-3", "-3"),
    ("\u22123", "-3"),  # unicode minus sign
    ("25%", "25"),  # GSM8K stores percentages as bare numbers
    ("25\\%", "0.25"),
    ("123456789012345678901234567890", "123456789012345678901234567890"),
    ("\\frac{1}{2}", "0.5"),  # a fraction is a number form
    ("0.5", "\\frac{1}{2}"),
    ("\\dfrac{3}{6}", "0.5"),
    ("2\\sqrt{2}", "\\sqrt{8}"),  # symbolic path (math_verify in a worker): the gold is no number
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
    ("1+x", "x+1"),
    ("18", 18),  # int ground truth
    ("0.5", 0.5),  # float ground truth
    ("100000000000000000000", 1e20),  # float ground truth compared exactly
    ("18", ["17", "18"]),  # any of a list
]


@pytest.mark.parametrize("answer,ground_truth", RIGHT_CASES)
def test_right_answers_score_one(answer, ground_truth):
    assert r1_zero_reward_fn(respond(answer), ground_truth) == RIGHT


# --------------------------------------------------------------------------- wrong answers

WRONG_CASES = [
    ("-3", "3"),
    ("3", "-3"),
    ("17", "18"),
    ("18.01", "18"),
    ("1,000", "100"),
    ("0.25", "25"),
    # Differ in the last digit; equal as floats (both round to 1.2345678901234567e19).
    ("12345678901234567891", "12345678901234567890"),
    ("18 or 19", "18"),  # hedging is not an answer
    ("\\frac{1}{3}", "0.5"),
    ("\\sqrt{5}", "2"),
    ("\\sqrt{16}", "4"),  # arithmetic left undone is no number (see ARITHMETIC_ANSWERS)
    ("2^{3}", "8"),
    ("\\sqrt{5}", "\\sqrt{8}"),
    ("x", "18"),
    ("eighteen", "18"),
    ("18", ["17", "19"]),
    ("0.3333333", "0.333333333"),  # exact by default; fast=False is lenient (below)
]


@pytest.mark.parametrize("answer,ground_truth", WRONG_CASES)
def test_wrong_answers_score_zero_with_format_credit(answer, ground_truth):
    assert r1_zero_reward_fn(respond(answer), ground_truth) == WRONG


# --------------------------------------------------------------------------- no free credit

# Words after the number that negate, hedge or scale it; a percent read a second way; several
# candidates. Each of these scored 1 for the ground truth 18 (or the one given) before.
FREE_CREDIT = [
    ("18 is not the answer", "18"),
    ("18 or nineteen", "18"),
    ("18 or more", "18"),
    ("at least 18", "18"),
    ("18 thousand", "18"),
    ("18k", "18"),
    ("18K", "18"),
    ("18m", "18"),
    ("18 dozen", "18"),
    ("18 squared", "18"),
    ("18 million dollars", "18"),
    ("1800%", "18"),
    ("1800\\%", "18"),
    ("0.25%", "0.25"),
    ("\\boxed{18} or \\boxed{20}", "20"),
    ("\\boxed{18} or \\boxed{20}", "18"),
    ("\\boxed{20} \\boxed{18}", ["18", "20"]),
]


@pytest.mark.parametrize("answer,ground_truth", FREE_CREDIT)
@pytest.mark.parametrize("fast", [True, False])
def test_no_free_credit(answer, ground_truth, fast):
    assert r1_zero_reward_fn(respond(answer), ground_truth, fast=fast) == WRONG


# Edges of the number forms: the length cap counts the answer without the spaces around it; spaces
# may group thousands; "~" before the number is "about" (after it, LaTeX's unbreakable space); a box
# closed twice is no answer.  Each of the first list was refused and each of
# the second credited before.
EDGES_CREDITED = [
    ("18" + " " * 1001, "18"),
    (" " * 1001 + "18" + "\n" * 1001, "18"),
    ("1 000", "1000"),
    ("1 000 000", "1000000"),
    ("$12 345.50", "12345.5"),
    ("1\u202f000", "1000"),  # a narrow no-break space
    ("\\boxed{1 000}", "1000"),
    ("$18~\\text{cm}$", "18"),
]
EDGES_REFUSED = [
    ("~18", "18"),
    ("~ 18", "18"),
    ("\\boxed{~18}", "18"),
    ("$\\sim 18$", "18"),
    ("about 18", "18"),
    ("\\boxed{18}}", "18"),
    ("The answer is \\boxed{18} }.", "18"),
    ("\\boxed{\\boxed{18}}}", "18"),
    ("1 00", "100"),  # no thousands grouping
    ("1 000/2", "500"),  # a grouped numerator is no fraction
    ("18" + "\\," * 500, "18"),  # 1002 characters of answer: over the cap
]


@pytest.mark.parametrize("answer,ground_truth", EDGES_CREDITED)
def test_number_form_edges_that_are_the_answer(answer, ground_truth):
    assert r1_zero_reward_fn(respond(answer), ground_truth) == RIGHT


@pytest.mark.parametrize("answer,ground_truth", EDGES_REFUSED)
@pytest.mark.parametrize("fast", [True, False])
def test_number_form_edges_that_are_not(answer, ground_truth, fast):
    assert r1_zero_reward_fn(respond(answer), ground_truth, fast=fast) == WRONG


def test_the_answer_cap_is_the_same_in_every_format():
    padded = "18" + " " * 1001
    assert [grade_batch([response], ["18"], answer_format=fmt)[0] for fmt, response in (
        ("r1_tags", respond(padded)), ("boxed", f"So \\boxed{{{padded}}}"), ("gsm8k", f"#### {padded}"))] == [RIGHT] * 3


# A number followed by a unit (with a power) is still the number; one candidate boxed twice is
# one candidate.
UNITS_AND_REPEATS = [
    ("18 \\text{ cm}^2", "18"),
    ("18 cm^{2}", "18"),
    ("18 m\u00b2", "18"),
    ("18 m", "18"),
    ("18 miles per hour", "18"),
    ("5 km/h", "5"),
    ("3 sq. ft", "3"),
    ("18 cups of flour", "18"),
    ("18 years old", "18"),
    ("18%", "18"),
    ("25%", "0.25"),
    ("1800%", "1800"),
    ("\\boxed{18} so the answer is \\boxed{18.0}", "18"),
    ("\\boxed{\\boxed{18}}", "18"),
]


@pytest.mark.parametrize("answer,ground_truth", UNITS_AND_REPEATS)
def test_units_and_repeated_answers_are_credited(answer, ground_truth):
    assert r1_zero_reward_fn(respond(answer), ground_truth) == RIGHT


@pytest.mark.parametrize(
    "text,expected",
    [
        ("\\boxed{18} or \\boxed{20}", ["18", "20"]),
        ("\\boxed{18} i.e. \\boxed{18.00}", ["18"]),
        ("\\boxed{\\frac{1}{2}} = \\boxed{0.5}", ["\\frac{1}{2}"]),
        ("\\boxed{x + 1} or \\boxed{x+1}", ["x + 1"]),
        ("\\fbox{3} \\boxed{4}", ["3", "4"]),
        (" 18 ", ["18"]),
        ("  ", []),
    ],
)
def test_distinct_candidates(text, expected):
    assert distinct_candidates(text) == expected


# --------------------------------------------------------------------------- number forms only

# A numeric ground truth is matched only by an answer written as a number (issue: "16+2" for 18
# was credited because math_verify evaluated it).
NUMBER_FORMS = [
    ("18", ["18", "18.0", "+18", "$18", "\\$18", "$18$", "18.", " 18 ", "**18**", "18 dollars",
            "18 apples", "\\text{18}", "18 \\text{ apples}", "\\boxed{18}", "\\boxed{\\$18}",
            "So the answer is \\boxed{18}.", "x = 18", "= 18", "18.00"]),
    ("1000", ["1000", "1,000", "1{,}000", "1\\,000", "$1,000.00", "\\boxed{1,000}"]),
    ("0.5", ["0.5", ".5", "1/2", "2/4", "\\frac{1}{2}", "\\dfrac{1}{2}", "\\tfrac{1}{2}", "\\frac12",
             "\\frac{ 1 }{ 2 }", "\\boxed{\\frac{1}{2}}", "50%", "50\\%"]),
    ("-0.75", ["-0.75", "-3/4", "-\\frac{3}{4}", "\\frac{-3}{4}", "\u2212\\frac{3}{4}"]),
    ("50", ["50", "50%", "50\\%", "50 percent"]),
    ("\\frac{1}{3}", ["1/3", "\\frac{2}{6}"]),
    ("\\frac{36}{2}", ["18"]),  # a ground truth may be written as a whole-number fraction
]

ARITHMETIC_ANSWERS = [
    ("18", ["16+2", "16 + 2", "20-2", "2*9", "2 * 9", "2 \\times 9", "2 \\cdot 9", "2(9)", "18 + 0",
            "18+0", "18 \\times 1", "18^1", "36/2", "36 / 2", "\\frac{36}{2}", "\\dfrac{36}{2}", "18/1",
            "\\boxed{16+2}", "$16+2$", "\\sqrt{324}", "sqrt(324)", "abs(-18)", "-(-18)", "16+2 = 18",
            "2 \\times 9 = 18", "x = 16+2", "1.8e1", "1.8 \\times 10^{1}",
            "\\lceil 17.5 \\rceil", "\\boxed{2 \\times 9}"]),
    ("81", ["9**2", "9^2", "9^{2}", "3^4", "81^{1}", "\\frac{162}{2}"]),
    ("6", ["3!", "\\binom{4}{2}", "\\frac{12}{2}"]),
    ("0.5", ["1/(2)", "\\frac{1}{1+1}", "1.5/3", "\\sin(\\pi/6)", "1 - 1/2", "\\frac{1}{2} + 0"]),
    ("2.5", ["2 1/2", "2\\frac{1}{2}"]),  # mixed numbers are ambiguous: 2\\frac{1}{2} reads as 1
    ("0", ["1/0", "0/5"]),
]


@pytest.mark.parametrize(
    "gold,answer", [(gold, answer) for gold, answers in NUMBER_FORMS for answer in answers]
)
def test_every_number_form_of_the_answer_is_credited(gold, answer):
    assert r1_zero_reward_fn(respond(answer), gold) == RIGHT
    assert default_grader().last_batch_stats.in_process == 1  # decided without math_verify


@pytest.mark.parametrize(
    "gold,answer", [(gold, answer) for gold, answers in ARITHMETIC_ANSWERS for answer in answers]
)
def test_arithmetic_left_undone_is_not_credited(gold, answer):
    assert r1_zero_reward_fn(respond(answer), gold) == WRONG
    stats = default_grader().last_batch_stats
    assert (stats.in_process, stats.symbolic) == (1, 0)  # never handed to math_verify


def test_number_forms_in_one_batch_are_graded_without_workers():
    pairs = [(a, g) for g, answers in NUMBER_FORMS for a in answers]
    wrong = [(a, g) for g, answers in ARITHMETIC_ANSWERS for a in answers]
    with Grader(workers=1) as grader:
        grades = grader.grade_batch([respond(a) for a, _ in pairs + wrong], [g for _, g in pairs + wrong])
        assert grades == [RIGHT] * len(pairs) + [WRONG] * len(wrong)
        assert grader.num_workers == 0


def test_fast_false_never_credits_arithmetic():
    # fast=False sends two numbers to math_verify for rounding, never an expression.
    assert r1_zero_reward_fn(respond("16+2"), "18", fast=False) == WRONG
    assert r1_zero_reward_fn(respond("\\sqrt{324}"), "18", fast=False) == WRONG
    assert r1_zero_reward_fn(respond("1/3"), "0.3333333", fast=False) == RIGHT


def test_expressions_still_match_a_symbolic_ground_truth():
    assert r1_zero_reward_fn(respond("\\sqrt{8}"), "2\\sqrt{2}") == RIGHT
    assert default_grader().last_batch_stats.symbolic == 1
    assert r1_zero_reward_fn(respond("16+2"), "x+2") == WRONG
    # A list of golds mixes both rules: the number gold needs a number, the other goes symbolic.
    assert r1_zero_reward_fn(respond("2\\sqrt{2}"), ["2.83", "\\sqrt{8}"]) == RIGHT
    assert r1_zero_reward_fn(respond("16+2"), ["18", "\\sqrt{8}"]) == WRONG


@pytest.mark.parametrize(
    "text,expected",
    [
        ("18", (Fraction(18), False)),
        ("\\boxed{-\\frac{3}{4}}", (Fraction(-3, 4), False)),
        ("25\\%", (Fraction(25), True)),
        ("3/4 cup", (Fraction(3, 4), False)),
        ("y = 1,000.5", (Fraction(2001, 2), False)),
        ("36/2", None),
        ("16+2", None),
        ("1/0", None),
        ("2\\frac{1}{2}", None),
        ("1e3", None),
    ],
)
def test_parse_number_form(text, expected):
    assert parse_number_form(text) == expected


def test_parse_number_form_reads_whole_fractions_for_ground_truths():
    assert parse_number_form("\\frac{36}{2}") is None
    assert parse_number_form("\\frac{36}{2}", whole_fractions=True) == (Fraction(18), False)


def test_fast_false_lets_math_verify_round_numbers():
    # math_verify compares numbers to 6 decimals; the exact path does not.
    assert r1_zero_reward_fn(respond("0.3333333"), "0.333333333", fast=False) == RIGHT
    assert r1_zero_reward_fn(respond("18"), "18.5", fast=False) == WRONG


# --------------------------------------------------------------------------- MATH-style golds

# Golds as rlft.data.rows reads them from a MATH solution's last \boxed{} (LaTeX kept whole), answers of
# the same value, and answers that are not.  A gold that is a number form (\frac{1}{2}, -\frac{3}{4},
# 0.75) is decided in this process; the others go to math_verify in a worker.
MATH_GOLDS = [
    ("\\frac{1}{2}", ["0.5", "1/2", "\\dfrac{1}{2}", "\\frac12", "2/4", "\\frac{2}{4}", "\\boxed{\\frac{1}{2}}"],
     ["\\frac{1}{3}", "0.50001", "2", "\\frac{1}{2} + 0", "\\frac{x}{2}", "\\frac{1}{2} or \\frac{1}{3}",
      "\\boxed{\\frac{1}{2}} or \\boxed{\\frac{1}{3}}"]),
    ("-\\frac{3}{4}", ["-0.75", "\\frac{-3}{4}", "-\\frac34", "-3/4"], ["\\frac{3}{4}", "0.75", "-\\frac{4}{3}"]),
    ("\\frac{7}{2}", ["3.5", "7/2"], ["3\\frac{1}{2}", "7/2 or 3"]),  # a mixed number is no number form
    ("0.75", ["\\frac{3}{4}", "3/4", ".75"], ["\\frac{3}{5}", "0.7"]),
    ("-4", ["-4", "x = -4", "\\boxed{-4}"], ["4", "-4 or 4"]),
    ("2\\sqrt{3}", ["\\sqrt{12}", "2 \\sqrt 3", "3.4641016"], ["2\\sqrt{2}", "\\sqrt{6}", "3.46", "12"]),
    ("\\frac{\\sqrt{3}}{2}", ["\\frac{1}{2}\\sqrt{3}", "\\dfrac{\\sqrt3}{2}"], ["\\frac{\\sqrt{2}}{2}", "\\frac{3}{2}"]),
    ("\\sqrt{2}", ["\\sqrt2", "\\frac{2}{\\sqrt{2}}"], ["1.414", "2"]),  # math_verify's floats: 6 decimals
    ("[2, 5)", ["[2,5)", "x \\in [2, 5)"], ["(2,5)", "[2,5]", "(2,5]", "[2, 5) or (2, 5)"]),
    ("(-\\infty, 4]", ["(-\\infty,4]"], ["(-\\infty, 4)", "(4, \\infty)", "4"]),
    ("(5, 7)", ["(5,7)", "x = 5, y = 7"], ["(7, 5)", "5", "7", "(5, 7) or (7, 5)"]),  # an ordered pair
    ("90^\\circ", ["90", "90^\\circ", "90^{\\circ}"], ["45", "\\frac{\\pi}{2}", "180"]),
    ("5\\text{ cm}", ["5", "5 cm", "5\\text{ cm}"], ["6", "50 mm"]),
]


@pytest.mark.parametrize("gold,answer", [(g, a) for g, right, _ in MATH_GOLDS for a in right])
def test_math_golds_credit_the_same_value_written_otherwise(gold, answer):
    assert r1_zero_reward_fn(respond(answer), gold) == RIGHT
    boxed = answer if answer.startswith("\\boxed") else f"\\boxed{{{answer}}}"
    assert grade_batch([f"So the answer is {boxed}."], [gold], answer_format="boxed")[0] == RIGHT


@pytest.mark.parametrize("gold,answer", [(g, a) for g, _, wrong in MATH_GOLDS for a in wrong])
@pytest.mark.parametrize("fast", [True, False])
def test_math_golds_give_no_free_credit(gold, answer, fast):
    assert r1_zero_reward_fn(respond(answer), gold, fast=fast) == WRONG


def test_math_golds_read_from_a_solution_are_graded_whole():
    from rlft.data.rows import read_boxed

    solutions = ["Adding, $\\frac{1}{4} + \\frac{1}{4} = \\boxed{\\frac{1}{2}}$.",
                 "The solution set is $\\boxed{[2, 5)}$.", "They meet at $\\boxed{(5, 7)}$."]
    golds = [read_boxed(s)[0] for s in solutions]
    assert golds == ["\\frac{1}{2}", "[2, 5)", "(5, 7)"]
    grades = grade_batch([respond(a) for a in ("0.5", "[2,5)", "(7,5)")], golds)
    assert grades == [RIGHT, RIGHT, WRONG]


# --------------------------------------------------------------------------- format

FORMAT_CASES = [
    ("18 <answer>18</answer>", NO_FORMAT),  # missing </think>
    ("x </think><answer>18</answer>", NO_FORMAT),  # no space between the tags
    ("x </think> <answer>18", NO_FORMAT),  # missing </answer>
    ("<answer>18</answer>", NO_FORMAT),  # answer tag only
    ("", NO_FORMAT),
    ("x </think> <answer></answer>", WRONG),  # empty answer
    ("x </think> <answer>   </answer>", WRONG),
    ("x </think> <answer>\\boxed{18</answer>", WRONG),  # unbalanced box
    ("x </think> <answer>17</answer> <answer>18</answer>", RIGHT),  # the last answer counts
    ("x </think> <answer>18</answer>\n", RIGHT),
]


@pytest.mark.parametrize("response,expected", FORMAT_CASES)
def test_format_rules(response, expected):
    assert r1_zero_reward_fn(response, "18") == expected


def test_extract_answer_text():
    assert extract_answer_text("a </think> <answer> 42 </answer>") == " 42 "
    assert extract_answer_text("a </think> <answer>so \\boxed{\\frac{1}{2}}</answer>") == "\\frac{1}{2}"
    assert extract_answer_text("a </think> <answer>\\boxed{4</answer>") is None
    assert extract_answer_text("a </think><answer>42</answer>") is None
    assert extract_boxed("\\boxed{a} then \\boxed{b{c}}") == "b{c}"
    assert extract_boxed("\\boxed 18$") == "18"
    assert extract_boxed("\\boxed {18}") == "18"
    assert extract_boxed("no box") is None


@pytest.mark.parametrize(
    "text,expected",
    [
        ("$1,000.00", "1000"),
        ("18.0", "18"),
        ("-3.50", "-3.5"),
        ("\\boxed{18}", "18"),
        ("18 dollars", "18"),
        ("25%", "25"),
        ("\\text{7}", "7"),
        ("0.0", "0"),
        (".5", "0.5"),
        ("1/2", None),
        ("1,00", None),  # not a thousands grouping
        ("18 or 19", None),
        ("abc", None),
        ("9" * 2000, None),  # over-long
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


# --------------------------------------------------------------------------- hostile outputs

RUNAWAY = "(x+1)^{999}"  # passes the safety filter; sympy expands it for minutes


def hostile_answers(marker):
    """Answers that must score 0 without running anything; all are refused before any parsing."""
    return [
        f"__import__('os').system('touch {marker}')",
        f"\\boxed{{__import__('os').system('touch {marker}')}}",
        f"exec(\"import os; os.system('touch {marker}')\")",
        f"(lambda: __import__('os').system('touch {marker}'))()",
        "9**9**9**9",
        "10^10^10^10",
        "10^{10^{10^{10}}}",
        "2^{99999999}",
        "(" * 5000 + "1" + ")" * 5000,
        "(" * 400 + "1" + ")" * 400,  # short enough for the parser, too deep for it
        "7" * 200_000,
        "\\frac{1}{2}" * 20_000,
        "\\boxed{" * 50,
        "9**2",  # would equal the ground truth 81 if evaluated as Python
    ]


@pytest.mark.parametrize("gold", ["81", "9^{2}"])  # a number; an expression (symbolic path)
@pytest.mark.parametrize("index", range(len(hostile_answers("marker"))))
def test_hostile_answer_scores_zero_quickly_and_runs_nothing(tmp_path, index, gold):
    marker = tmp_path / "pwned_x"
    answer = hostile_answers(marker)[index]
    t0 = time.monotonic()
    result = r1_zero_reward_fn(respond(answer), gold)
    elapsed = time.monotonic() - t0
    assert result == WRONG
    assert elapsed < HOSTILE_SECONDS
    assert not marker.exists()


def test_total_timeout_zeroes_and_counts_unfinished_items():
    grader = default_grader()
    grader.start(1)
    pids_before = set(grader.worker_pids)
    # One worker, three runaway checks, 1 s for the whole batch: the first is cut off at the
    # batch deadline, the other two never start; the plain number is decided in-process.
    t0 = time.monotonic()
    results = grade_batch(
        [respond(RUNAWAY), respond("18"), respond(RUNAWAY), respond(RUNAWAY)],
        ["\\sqrt{7}", "18", "\\sqrt{7}", "\\sqrt{7}"],
        timeout_per_item=30.0,
        total_timeout=1.0,
        workers=1,
    )
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < 2.5
    assert results == [NO_FORMAT, RIGHT, NO_FORMAT, NO_FORMAT]
    stats = grader.last_batch_stats
    assert (stats.unfinished, stats.in_process, stats.timed_out) == (3, 1, 0)
    (killed,) = pids_before - set(grader.worker_pids)  # the one mid-check at the deadline
    with pytest.raises(ProcessLookupError):
        os.kill(killed, 0)
    assert grader.num_workers == len(pids_before)  # replaced


def test_runaway_check_is_killed_at_its_deadline_and_pool_recovers():
    grader = default_grader()
    grader.start(1)
    pids_before = set(grader.worker_pids)
    t0 = time.monotonic()
    assert r1_zero_reward_fn(respond("\\sum_{k=1}^{999} k^{999}"), "\\sqrt{7}") == WRONG
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < HOSTILE_SECONDS  # it ran to the 1 s deadline, then was cut off
    assert grader.last_batch_stats.timed_out == 1
    killed = pids_before - set(grader.worker_pids)
    assert len(killed) == 1
    with pytest.raises(ProcessLookupError):
        os.kill(killed.pop(), 0)
    assert grader.num_workers == 2  # a replacement was started at once
    assert r1_zero_reward_fn(respond("\\sqrt{8}"), "2\\sqrt{2}") == RIGHT


def test_safety_filter():
    assert is_safe_for_symbolic("\\frac{1}{2}")
    assert is_safe_for_symbolic("\\sqrt{2} \\cdot \\cos(\\pi)\\;\\text{cm}")
    assert not is_safe_for_symbolic("__import__('os')")
    assert not is_safe_for_symbolic("lambda x: x")
    assert not is_safe_for_symbolic("os.system('ls')")
    assert not is_safe_for_symbolic("9**9")
    assert not is_safe_for_symbolic("10^{10^{10}}")
    assert not is_safe_for_symbolic("{" * 13 + "1" + "}" * 13)
    assert is_safe_for_symbolic("{" * 12 + "1" + "}" * 12)
    assert not is_safe_for_symbolic("1" * 1001)


# --------------------------------------------------------------------------- batches


def test_grade_batch_matches_per_item_calls_and_is_bounded(tmp_path):
    marker = tmp_path / "pwned_x"
    hostile = hostile_answers(marker)
    cases = (
        [(respond(a), g) for a, g in RIGHT_CASES]
        + [(respond(a), g) for a, g in WRONG_CASES]
        + [(r, "18") for r, _ in FORMAT_CASES]
        + [(respond(a), "81") for a in hostile]
        + [(respond(a), "9^{2}") for a in hostile]
    )
    expected = (
        [RIGHT] * len(RIGHT_CASES)
        + [WRONG] * len(WRONG_CASES)
        + [e for _, e in FORMAT_CASES]
        + [WRONG] * (2 * len(hostile))
    )
    singles = [r1_zero_reward_fn(r, g) for r, g in cases]
    assert singles == expected

    # The batch adds a runaway check, which a worker starts and is killed for at 1 s.
    responses = [r for r, _ in cases] + [respond(RUNAWAY)]
    truths = [g for _, g in cases] + ["\\sqrt{7}"]
    assert len(responses) >= 60
    t0 = time.monotonic()
    batch = grade_batch(responses, truths, total_timeout=20.0)
    assert time.monotonic() - t0 < 8.0
    assert batch == singles + [WRONG]
    assert not marker.exists()
    stats = default_grader().last_batch_stats
    assert stats.graded == len(responses) and stats.unfinished == 0
    # Against "81" every hostile answer is wrong at once (no number). Against "9^{2}" every one but
    # the over-long (3) and unbalanced-box (1) ones is refused by the safety filter before parsing.
    assert stats.rejected == len(hostile) - 4
    # The runaway must hit its deadline; on a loaded machine an ordinary check may too.
    assert stats.timed_out >= 1


def test_workers_start_lazily():
    with Grader(workers=1) as grader:
        assert grader.grade(respond("$18"), "18") == RIGHT
        assert grader.grade(respond("17"), ["18", 19]) == WRONG
        assert grader.grade("no tags at all", "18") == NO_FORMAT
        assert grader.num_workers == 0  # nothing starts until a symbolic check is needed


def test_workers_are_light_and_close_stops_them():
    grader = default_grader()
    grader.start(1)
    pids = grader.worker_pids
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            rss_kib = int(f.read().split("VmRSS:")[1].split()[0])
        assert rss_kib < 300 * 1024  # sympy + math_verify only, no torch
    grader.close()
    assert grader.num_workers == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_bad_input_is_rejected_with_clear_errors():
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        grade_batch([respond("1"), respond("2")], ["1"])
    with pytest.raises(TypeError, match="ground_truth must be"):
        r1_zero_reward_fn(respond("1"), {"answer": 1})
    with pytest.raises(ValueError, match="empty list"):
        r1_zero_reward_fn(respond("1"), [])
    with pytest.raises(ValueError, match="timeout_per_item"):
        grade_batch([respond("1")], ["1"], timeout_per_item=0)


# Grouping braces and brackets around a number are the number; LaTeX spacing inside digits groups thousands
# only (before: "\\boxed{{18}}", "{1000}", "(-3)", "\\frac{{1}}{{2}}" were wrong answers, "1\\,8" and "1~8" were 18).
@pytest.mark.parametrize("gold,answer", [
    ("18", "\\boxed{{18}}"), ("1000", "{1000}"), ("-3", "(-3)"), ("0.5", "\\frac{{1}}{{2}}"), ("18", "(18)"),
    ("18", "\\left(18\\right)"), ("18", "{{18}}"), ("-3", "$(-3)$"), ("1000", "1\\,000"), ("1000", "1~000"),
    ("1000000", "1\\,000\\,000"), ("1000", "(1,000)"),
])
def test_grouped_numbers_are_the_number(gold, answer):
    assert r1_zero_reward_fn(respond(answer), gold) == RIGHT


@pytest.mark.parametrize("gold,answer", [
    ("18", "1\\,8"), ("18", "1~8"), ("18", "1\\;8"), ("18", "1 8"), ("1234", "12\\,34"), ("3", "(1, 2)"),
    ("12", "{1}{2}"),
])
def test_latex_spacing_inside_digits_is_no_thousands_separator(gold, answer):
    assert r1_zero_reward_fn(respond(answer), gold) == WRONG


def test_boxed_grading_is_linear_in_the_response_and_bounded_in_time():
    from rlft.reward.formats import split_boxed

    # Before, 8 MB of boxes took 111 s in the grader's own process (each box copied the text after it).
    for n in (20_000, 80_000):
        start = time.perf_counter()
        assert split_boxed("\\boxed{18}" * n) == (True, "18")
        seconds = time.perf_counter() - start
        assert seconds < 0.02 * n / 1000, (n, seconds)  # 20 us a box, at most
    with Grader(workers=1) as grader:
        start = time.perf_counter()
        grades = grader.grade_batch(["\\boxed{18}" * 800_000, "\\boxed{18}"], ["18", "18"], answer_format="boxed",
                                    timeout_per_item=0.5)
        assert time.perf_counter() - start < 5
        assert grades == [{"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}, RIGHT]
        assert grader.last_batch_stats.timed_out == 1
