"""Tests for rlft.reward.functions: the default reward unchanged, format shaping, and custom reward
functions run (and cut off) in the grader's worker processes."""

import os
import sys
import textwrap
import time

import pytest

from rlft.reward.grader import Grader, grade_batch
from rlft.reward.functions import DEFAULT_REWARD_FN, make_reward_fn, validate_format_weight, validate_reward_fn

# A module of custom reward functions, written to a directory that only this process's sys.path
# knows about: the workers must be given it.
CUSTOM = textwrap.dedent(
    """
    import os
    import time

    def contains(response, ground_truth):
        return 1.0 if f"<answer>{ground_truth}</answer>" in response else 0.0

    def scored(response, ground_truth):
        return {"reward": 2.0, "format_reward": 0.5, "answer_reward": 1.0, "note": "dropped"}

    def half(response, ground_truth):
        return {"reward": 0.5}

    def verdict(response, ground_truth):
        return response == ground_truth  # a bool counts as 0/1

    def worker_pid(response, ground_truth):
        return float(os.getpid())

    def misbehaves(response, ground_truth):
        if response == "hang":
            time.sleep(600)
        if response == "spin":
            while True:
                pass
        if response == "raise":
            raise ZeroDivisionError("no reward today")
        if response == "die":
            os._exit(3)
        return 1.0

    def returns_str(response, ground_truth):
        return "yes"

    def returns_none(response, ground_truth):
        return None

    def returns_nan(response, ground_truth):
        return float("nan")

    def returns_list(response, ground_truth):
        return [1.0]

    def dict_without_reward(response, ground_truth):
        return {"score": 1.0}

    def dict_with_text(response, ground_truth):
        return {"reward": "high"}

    def one_argument(response):
        return 1.0

    NOT_CALLABLE = 3
    """
)
SLOW_IMPORT = "import time\ntime.sleep(1.5)\n\ndef reward(response, ground_truth):\n    return 1.0\n"
BROKEN_IMPORT = "raise RuntimeError('this module cannot be imported')\n"

RIGHT = "I added them. </think> <answer>18</answer>"
WRONG_BUT_FORMATTED = "I added them. </think> <answer>17</answer>"
NO_FORMAT = "I added them. <answer>18</answer>"
ARITHMETIC = "I added them. </think> <answer>16+2</answer>"

HANG_SLACK = 2.5  # seconds beyond the time bound, for a loaded 2-core machine


@pytest.fixture(scope="module")
def custom_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("custom_rewards")
    (path / "rlft_test_custom_rewards.py").write_text(CUSTOM)
    (path / "rlft_test_slow_import.py").write_text(SLOW_IMPORT)
    (path / "rlft_test_broken_import.py").write_text(BROKEN_IMPORT)
    sys.path.insert(0, str(path))
    yield path
    sys.path.remove(str(path))


@pytest.fixture(scope="module")
def grader(custom_dir):
    """A grader of its own with two workers, started once (imports cost seconds here)."""
    with Grader(workers=2) as g:
        g.start()
        yield g


def custom(name: str) -> str:
    return f"rlft_test_custom_rewards:{name}"


# --------------------------------------------------------------------------- the default reward


def test_default_is_the_r1_zero_reward_unchanged():
    half = "x </think> <answer>\\frac{1}{2}</answer>"
    responses = [RIGHT, WRONG_BUT_FORMATTED, NO_FORMAT, ARITHMETIC, half]
    truths = ["18", "18", "18", "18", "0.5"]
    reward_fn = make_reward_fn()
    assert reward_fn.fn == DEFAULT_REWARD_FN and reward_fn.format_weight == 0.0
    assert reward_fn(responses, truths) == grade_batch(responses, truths)
    assert [g["reward"] for g in reward_fn(responses, truths)] == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert reward_fn.last_batch_stats.graded == 5


def test_format_shaping_on_the_default_reward_hand_worked():
    # w = 0.1: right 1 + 0.1; well-formed but wrong 0 + 0.1; broken format 0.
    reward_fn = make_reward_fn(DEFAULT_REWARD_FN, format_weight=0.1)
    grades = reward_fn([RIGHT, WRONG_BUT_FORMATTED, NO_FORMAT, ARITHMETIC], ["18"] * 4)
    assert grades == [
        {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0 + 0.1},
        {"format_reward": 1.0, "answer_reward": 0.0, "reward": 0.1},
        {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0},
        {"format_reward": 1.0, "answer_reward": 0.0, "reward": 0.1},
    ]
    assert all(0.0 <= g["reward"] <= 1.1 for g in grades)


def test_format_weight_and_timeouts_are_checked():
    assert validate_format_weight(0) == 0.0
    for bad in (-0.1, float("nan"), float("inf"), "0.1", True):
        with pytest.raises(ValueError, match="format_weight must be a finite number >= 0"):
            make_reward_fn(format_weight=bad)
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        make_reward_fn(timeout_s=0)
    with pytest.raises(ValueError, match="total_timeout_s must be a positive number"):
        make_reward_fn(total_timeout_s=-1)


# --------------------------------------------------------------------------- naming a function


@pytest.mark.parametrize(
    "spec,message",
    [
        ("rlft_test_custom_rewards.contains",
         "^reward function 'rlft_test_custom_rewards.contains': expected 'package.module:function'$"),
        ("rlft_test_custom_rewards:",
         "^reward function 'rlft_test_custom_rewards:': expected 'package.module:function'$"),
        ("", "^reward function '': expected 'package.module:function'$"),
        ("no_such_package_xyz.rewards:fn",
         "cannot import module 'no_such_package_xyz.rewards' \\(ModuleNotFoundError"),
        ("rlft_test_broken_import:reward",
         "importing module 'rlft_test_broken_import' failed \\(RuntimeError: this module cannot"),
        ("rlft_test_custom_rewards:missing", "module 'rlft_test_custom_rewards' has no attribute 'missing'"),
        ("rlft_test_custom_rewards:NOT_CALLABLE", "is not callable \\(it is a int\\)"),
        ("rlft_test_custom_rewards:one_argument", "must accept \\(response, ground_truth\\)"),
    ],
)
def test_a_bad_function_name_is_a_one_line_error(custom_dir, spec, message):
    with pytest.raises(ValueError, match=message) as info:
        validate_reward_fn(spec)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=message):
        make_reward_fn(spec)


def test_good_function_names_validate(custom_dir):
    validate_reward_fn(DEFAULT_REWARD_FN)
    validate_reward_fn(custom("contains"))
    validate_reward_fn(" " + custom("contains") + " ")


# --------------------------------------------------------------------------- custom functions


def test_custom_function_runs_in_a_worker(grader):
    reward_fn = make_reward_fn(custom("worker_pid"), grader=grader)
    (grade,) = reward_fn([RIGHT], ["18"])
    assert int(grade["reward"]) in grader.worker_pids
    assert int(grade["reward"]) != os.getpid()
    assert reward_fn.last_batch_stats.custom == 1


def test_custom_function_rewards_and_format_shaping_hand_worked(grader):
    responses = [RIGHT, WRONG_BUT_FORMATTED, NO_FORMAT, "nothing"]
    truths = ["18", "18", "18", "18"]
    # A number: answer_reward = reward; format_reward from the R1-Zero format check.
    assert make_reward_fn(custom("contains"), grader=grader)(responses, truths) == [
        {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0},
        {"format_reward": 1.0, "answer_reward": 0.0, "reward": 0.0},
        {"format_reward": 0.0, "answer_reward": 1.0, "reward": 1.0},
        {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0},
    ]
    # w = 0.1 adds 0.1 * format_reward.
    assert make_reward_fn(custom("contains"), 0.1, grader=grader)(responses, truths) == [
        {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0 + 0.1},
        {"format_reward": 1.0, "answer_reward": 0.0, "reward": 0.1},
        {"format_reward": 0.0, "answer_reward": 1.0, "reward": 1.0},
        {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0},
    ]
    # A dict's own format_reward is used (and extra keys dropped): 2 + 0.1 * 0.5.
    assert make_reward_fn(custom("scored"), 0.1, grader=grader)([NO_FORMAT], ["18"]) == [
        {"format_reward": 0.5, "answer_reward": 1.0, "reward": 2.0 + 0.1 * 0.5}
    ]
    assert make_reward_fn(custom("half"), grader=grader)([RIGHT, NO_FORMAT], [18, 18]) == [
        {"format_reward": 1.0, "answer_reward": 0.5, "reward": 0.5},
        {"format_reward": 0.0, "answer_reward": 0.5, "reward": 0.5},
    ]
    verdicts = make_reward_fn(custom("verdict"), grader=grader)(["a", "b"], ["a", "a"])
    assert [g["reward"] for g in verdicts] == [1.0, 0.0]


@pytest.mark.parametrize(
    "name,shown",
    [
        ("returns_str", "returned 'yes' \\(str\\)"),
        ("returns_none", "returned None \\(NoneType\\)"),
        ("returns_nan", "returned nan \\(float\\), not a finite number"),
        ("returns_list", "returned \\[1.0\\] \\(list\\)"),
        ("dict_without_reward", "returned a dict without a 'reward' key: \\{'score': 1.0\\}"),
        ("dict_with_text", "returned reward = 'high' \\(str\\), not a finite number"),
    ],
)
def test_a_function_that_returns_no_reward_is_a_clear_error(grader, name, shown):
    reward_fn = make_reward_fn(custom(name), grader=grader)
    with pytest.raises(TypeError, match=f"reward function '{custom(name)}' {shown}") as info:
        reward_fn([RIGHT, RIGHT, RIGHT], ["18", "18", "18"])
    assert "\n" not in str(info.value)
    # The pool is still usable afterwards.
    assert make_reward_fn(custom("contains"), grader=grader)([RIGHT], ["18"])[0]["reward"] == 1.0


def test_mismatched_inputs_are_an_error(grader):
    reward_fn = make_reward_fn(custom("contains"), grader=grader)
    with pytest.raises(ValueError, match="got 2 responses but 1 ground truths"):
        reward_fn([RIGHT, RIGHT], ["18"])
    with pytest.raises(TypeError, match="responses\\[0\\] must be a str"):
        reward_fn([None], ["18"])
    with pytest.raises(TypeError, match="ground_truths\\[0\\] must be a str, number or list"):
        reward_fn([RIGHT], [object()])


@pytest.mark.parametrize("misbehaviour", ["hang", "spin"])
def test_a_hanging_function_is_cut_at_the_time_bound_and_counted(grader, misbehaviour):
    grader.start()
    pids_before = set(grader.worker_pids)
    reward_fn = make_reward_fn(custom("misbehaves"), format_weight=0.1, timeout_s=1.0, grader=grader)
    reward_fn([RIGHT], ["18"])  # both workers have imported the function before timing starts
    t0 = time.monotonic()
    grades = reward_fn([misbehaviour, RIGHT, RIGHT], ["18", "18", "18"])
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < 1.0 + HANG_SLACK
    # The cut-off item gets nothing, not even the format bonus; the others are shaped.
    assert grades == [
        {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0},
        {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0 + 0.1},
        {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0 + 0.1},
    ]
    stats = reward_fn.last_batch_stats
    assert (stats.graded, stats.custom, stats.timed_out, stats.errors, stats.unfinished) == (3, 2, 1, 0, 0)
    killed = pids_before - set(grader.worker_pids)
    assert len(killed) == 1
    with pytest.raises(ProcessLookupError):
        os.kill(killed.pop(), 0)
    assert grader.num_workers == 2  # replaced at once


def test_a_function_that_raises_or_kills_its_worker_scores_zero_and_is_counted(grader):
    reward_fn = make_reward_fn(custom("misbehaves"), grader=grader)
    grades = reward_fn(["raise", "ok", "die", "ok"], ["18"] * 4)
    assert [g["reward"] for g in grades] == [0.0, 1.0, 0.0, 1.0]
    stats = reward_fn.last_batch_stats
    assert (stats.custom, stats.errors, stats.crashed, stats.timed_out) == (2, 1, 1, 0)


def test_a_function_failing_on_every_call_of_a_batch_stops_the_run_naming_it(grader, monkeypatch):
    # Before, every reward of such a batch was 0 (counted, nothing more): the run trained on nothing.
    from rlft.reward.functions import RewardFunctionError

    monkeypatch.setenv("RANK", "3")
    reward_fn = make_reward_fn(custom("misbehaves"), timeout_s=0.5, grader=grader)
    with pytest.raises(RewardFunctionError) as err:
        reward_fn(["raise", "die", "raise"], ["18", "19", "20"])
    assert str(err.value) == (
        f"reward.fn {custom('misbehaves')}: every call of a batch of 3 failed (errors=2, timed_out=0, crashed=1; "
        f"reward.timeout_s bounds each call), e.g. on the ground truth '18' (rank 3): every reward would be 0; "
        f"fix the function")
    # Given the questions (as the sampler gives them), it quotes the first, cut to 80 characters.
    question = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many?"
    with pytest.raises(RewardFunctionError) as err:
        reward_fn(["raise", "raise"], ["72", "72"], [question, "another"])
    assert str(err.value).endswith(
        f"e.g. on the question '{question[:80]}...' (ground truth '72', rank 3): every reward would be 0; "
        f"fix the function")
    assert str(err.value).startswith(f"reward.fn {custom('misbehaves')}: every call of a batch of 2 failed")
    with pytest.raises(RewardFunctionError, match=r"batch of 2 failed \(errors=0, timed_out=2, crashed=0"):
        reward_fn(["spin", "spin"], ["18", "18"])
    assert [g["reward"] for g in reward_fn(["raise", "ok"], ["18", "18"])] == [0.0, 1.0]  # one failure: counted
    assert [g["reward"] for g in reward_fn(["raise"], ["18"])] == [0.0]  # a batch of one proves little


def test_the_whole_batch_is_bounded(grader):
    reward_fn = make_reward_fn(custom("misbehaves"), timeout_s=30.0, total_timeout_s=1.0, grader=grader)
    reward_fn(["ok"], ["18"])
    t0 = time.monotonic()
    grades = reward_fn(["hang", "hang", "hang"], ["18"] * 3)
    assert 1.0 <= time.monotonic() - t0 < 1.0 + HANG_SLACK
    assert all(g["reward"] == 0.0 for g in grades)
    stats = reward_fn.last_batch_stats
    assert (stats.unfinished, stats.timed_out) == (3, 0)  # two cut mid-call, one never started


def test_import_time_does_not_count_against_the_per_item_bound(grader):
    # The module sleeps 1.5 s on import; each call may take only 0.5 s.
    reward_fn = make_reward_fn("rlft_test_slow_import:reward", timeout_s=0.5, grader=grader)
    assert [g["reward"] for g in reward_fn([RIGHT, RIGHT], ["18", "18"])] == [1.0, 1.0]
    assert reward_fn.last_batch_stats.timed_out == 0


def test_a_worker_that_cannot_import_the_function_is_an_error(grader, tmp_path):
    (tmp_path / "rlft_test_only_here.py").write_text("def reward(response, ground_truth):\n    return 1.0\n")
    sys.path.insert(0, str(tmp_path))
    try:
        validate_reward_fn("rlft_test_only_here:reward")  # importable here...
        with pytest.raises(RuntimeError, match="cannot import module 'rlft_test_only_here'"):
            grader.call_batch("rlft_test_only_here:reward", [RIGHT], ["18"], path=[])  # ...not there
    finally:
        sys.path.remove(str(tmp_path))
