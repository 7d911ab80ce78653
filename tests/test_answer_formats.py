"""The answer formats (rlft/reward/formats.py): what is well-formed, where the answer is, the sampler's
stop strings, and that each is graded with the same number rules."""
from __future__ import annotations

import pytest

from rlft.config import ConfigError, load_config
from rlft.reward.formats import ANSWER_FORMATS, get_answer_format
from rlft.reward.functions import make_reward_fn
from rlft.reward.grader import Grader

RIGHT = {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}
WRONG = {"format_reward": 1.0, "answer_reward": 0.0, "reward": 0.0}
NO_FORMAT = {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}

# (format, response, ground truth, expected reward dict), worked by hand.
CASES = [
    # r1_tags: the seed's contract, unchanged.
    ("r1_tags", "2 + 2 = 4 </think> <answer> 4 </answer>", "4", RIGHT),
    ("r1_tags", "2 + 2 = 4 </think> <answer> 5 </answer>", "4", WRONG),
    ("r1_tags", "2 + 2 = 4 </think>\n<answer> 4 </answer>", "4", NO_FORMAT),  # the separator is exact
    ("r1_tags", "The answer is \\boxed{4}.", "4", NO_FORMAT),
    ("r1_tags", "</think> <answer> \\boxed{1,000} </answer>", "1000", RIGHT),
    # boxed: the last box, with the same number rules.
    ("boxed", "16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\nThe answer is $\\boxed{18}$.", "18", RIGHT),
    ("boxed", "So she makes \\boxed{\\$18}.", "18", RIGHT),
    ("boxed", "\\boxed{18.00}", "18", RIGHT),
    ("boxed", "\\boxed{1,080}", "1080", RIGHT),
    ("boxed", "\\boxed{\\frac{1}{2}}", "0.5", RIGHT),
    ("boxed", "First \\boxed{9}.\n\nThen the total is \\boxed{18}.", "18", RIGHT),  # an earlier paragraph's box
    ("boxed", "\\boxed{17}", "18", WRONG),
    ("boxed", "\\boxed{16+2}", "18", WRONG),  # arithmetic left undone is no number
    ("boxed", "It is either \\boxed{18} or \\boxed{20}.", "18", WRONG),  # candidates listed: no answer
    ("boxed", "It is either \\boxed{18} or \\boxed{20}.", "20", WRONG),
    ("boxed", "\\boxed{18} \\boxed{ 18 }", "18", RIGHT),  # the same answer twice
    ("boxed", "So \\boxed{18}, i.e. \\boxed{18.0}", "18", RIGHT),  # the same number twice
    ("boxed", "The answer is 18.", "18", NO_FORMAT),
    ("boxed", "The answer is \\boxed{18", "18", NO_FORMAT),  # the box never closes
    ("boxed", "The answer is \\boxed{18}}.", "18", NO_FORMAT),  # the box closed twice
    ("boxed", "The answer is \\boxed{18}.}.}", "18", RIGHT),  # text after the answer, however odd
    ("boxed", "</think> <answer> 18 </answer>", "18", NO_FORMAT),
    # gsm8k: a last line "#### N".
    ("gsm8k", "Natalia sold 48/2 = 24 clips in May.\n#### 72", "72", RIGHT),
    ("gsm8k", "#### 1,000", "1000", RIGHT),
    ("gsm8k", "#### 5\nWait, no.\n#### 7", "7", RIGHT),  # the last such line
    ("gsm8k", "#### 5\nWait, no.\n#### 7", "5", WRONG),
    ("gsm8k", "####", "5", WRONG),  # well-formed, nothing after it
    ("gsm8k", "The answer is 72 #### 72", "72", NO_FORMAT),  # not at a line's start
]


@pytest.mark.parametrize("fmt,response,truth,expected", CASES)
def test_each_format_grades_by_hand(fmt, response, truth, expected):
    with Grader(workers=1) as grader:
        assert grader.grade_batch([response], [truth], answer_format=fmt) == [expected]


def test_the_default_format_is_the_seeds():
    with Grader(workers=1) as grader:
        r = "2 + 2 = 4 </think> <answer> 4 </answer>"
        assert grader.grade_batch([r], ["4"]) == grader.grade_batch([r], ["4"], answer_format="r1_tags") == [RIGHT]


def test_unknown_format_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown answer format 'latex'.*\['boxed', 'gsm8k', 'r1_tags'\]"):
        get_answer_format("latex")


def test_stop_strings_follow_the_format():
    assert {name: f.stop for name, f in ANSWER_FORMATS.items()} == {
        "r1_tags": ("</answer>",), "boxed": (), "gsm8k": ()}
    assert load_config(None).sampling.stop == ["</answer>"]
    assert load_config(None, ["reward.answer_format=boxed"]).sampling.stop == []
    assert load_config(None, ["reward.answer_format=gsm8k"]).sampling.stop == []
    # An explicit list wins over the format's.
    assert load_config(None, ["reward.answer_format=boxed", 'sampling.stop=["\\n\\n\\n"]']).sampling.stop == ["\n\n\n"]


def test_config_refuses_an_unknown_format():
    from rlft.config import ConfigError

    with pytest.raises(ConfigError, match=r"^reward.answer_format: unknown answer format 'box'"):
        load_config(None, ["reward.answer_format=box"])


def test_reward_fn_grades_in_the_chosen_format_and_shapes_it():
    responses = ["So \\boxed{18}.", "So \\boxed{17}.", "So 18."]
    fn = make_reward_fn(answer_format="boxed", format_weight=0.1)
    assert [g["reward"] for g in fn(responses, ["18"] * 3)] == [1.1, 0.1, 0.0]
    fn = make_reward_fn()  # the seed's: none of these is well-formed
    assert [g["reward"] for g in fn(responses, ["18"] * 3)] == [0.0, 0.0, 0.0]


def test_custom_reward_gets_the_formats_check(tmp_path, monkeypatch):
    (tmp_path / "my_reward_mod.py").write_text("def reward(response, truth):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = make_reward_fn("my_reward_mod:reward", answer_format="boxed")
    grades = fn(["\\boxed{1}", "1"], ["1", "1"])
    assert [(g["reward"], g["format_reward"]) for g in grades] == [(0.5, 1.0), (0.5, 0.0)]


def test_one_gpu_memory_split_is_checked_with_the_numbers():
    import torch

    from rlft.config import ConfigError
    from rlft.runtime.memory_plan import check_shared_gpu, refuse_if_short, shared_gpu_plan

    gib = 2**30
    cfg = load_config(None, ["sampling.backend=vllm", "sampling.vllm.gpu_memory_utilization=0.35",
                             "optim.divergence_factor=0"])
    # 0.5B parameters in bf16: 20 bytes each for the policy (9.3 GiB), 2 for a reference (0.9 GiB).
    plan = shared_gpu_plan(cfg, total_bytes=140 * gib, params=500_000_000, policy_dtype=torch.bfloat16,
                           reference_here=True)
    assert plan["engine"] == pytest.approx(49.0) and plan["policy"] == pytest.approx(500e6 * 20 / gib)
    assert plan["reference"] == pytest.approx(500e6 * 2 / gib) and plan["headroom"] == pytest.approx(7.0)
    refuse_if_short(plan, cfg)  # fits: 72 GiB to spare
    # The update guard's copy of the fp32 weights and Adam's moments: 12 bytes more per parameter.
    guarded_cfg = load_config(None, ["sampling.backend=vllm", "sampling.vllm.gpu_memory_utilization=0.35"])
    guarded = shared_gpu_plan(guarded_cfg, total_bytes=140 * gib, params=500_000_000, policy_dtype=torch.bfloat16,
                              reference_here=True)
    assert guarded["policy"] - plan["policy"] == pytest.approx(500e6 * 12 / gib)
    # A 7B policy beside an engine taking 0.85 of the GPU cannot fit.
    cfg = load_config(None, ["sampling.backend=vllm", "sampling.vllm.gpu_memory_utilization=0.85",
                             "optim.divergence_factor=0"])
    plan = shared_gpu_plan(cfg, total_bytes=140 * gib, params=7_000_000_000, policy_dtype=torch.bfloat16,
                           reference_here=False)
    with pytest.raises(ConfigError, match=r"^sampling.vllm.gpu_memory_utilization: the policy and the vLLM engine "
                                          r"cannot share this GPU \(140 GiB\): engine 119 GiB \+ policy .* 130 GiB"):
        refuse_if_short(plan, cfg)
    # Nothing is shared on CPU, nor with an engine that holds no share of the GPU (HF generate).
    assert check_shared_gpu(cfg, model_path="unused", device=torch.device("cpu"), policy_dtype=torch.float32,
                            reference_here=True) is None
    hf = load_config(None, ["sampling.backend=hf"])
    assert check_shared_gpu(hf, model_path="unused", device=torch.device("cuda"), policy_dtype=torch.bfloat16,
                            reference_here=True) is None


@pytest.mark.parametrize("overrides,stop", [
    (["sampling.stop=[\"<answer>\"]"], "<answer>"),
    (["reward.answer_format=gsm8k", "sampling.stop=[\"####\"]"], "####"),
    (["reward.answer_format=boxed", "sampling.stop=[\"\\\\boxed\"]"], "\\boxed"),
    (["reward.answer_format=gsm8k", "sampling.stop=[\"\\n\"]"], "\n"),  # the reasoning's first line break
    (["data.prompt_template=chat", "sampling.stop=[\"<think>\"]"], "<think>"),  # a chat response opens its <think>
])
def test_a_stop_that_cuts_the_formats_answer_is_refused(overrides, stop):
    # Each gave a format reward of 0 on every step, without a word.
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    message = str(e.value)
    assert message.startswith(f"sampling.stop: {stop!r} cuts every ") and "so no response would earn a reward" in message
    assert "\n" not in message


def test_stops_after_the_answer_pass():
    assert load_config(None, ["sampling.stop=[\"</answer>\"]"]).sampling.stop == ["</answer>"]
    assert load_config(None, ["sampling.stop=[\"<think>\"]"]).sampling.stop == ["<think>"]  # the prompt opened it
    assert load_config(None, ["reward.answer_format=gsm8k", "sampling.stop=[\"\\n\\n\\n\"]"]).sampling.stop == ["\n\n\n"]


def test_an_empty_stop_string_is_refused_by_the_config():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["sampling.stop=[\"\"]"])
    assert str(e.value) == "sampling.stop: '' is no stop string (an empty one would stop every response at once); leave it out"
