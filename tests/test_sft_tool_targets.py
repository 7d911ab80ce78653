"""SFT targets holding tool calls and the tool's replies (rlft/envs/sft_targets.py, rlft/roles/sft_data.py):
with the calculator environment each target is tokenised as the episode it describes, with Qwen2.5's real
tokenizer and chat template, the replies out of the loss; without one, such rows are left out."""
from __future__ import annotations

import json

import pytest

from rlft.envs.sft_targets import TargetError, TargetTurn, split_target, target_token_ids

CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
# A GSM8K-style worked solution with two calls, the second answered by two replies.
SOLUTION = (f"{CALL.format('48 / 2')}\n<tool_response>\n24\n</tool_response>\nNatalia sold 24 clips in May.\n"
            f"{CALL.format('48 + 24')}{CALL.format('72 * 1')}\n<tool_response>\n72\n</tool_response>\n"
            "<tool_response>\n72\n</tool_response>\nAltogether 72 clips.\n#### 72")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from tiny_models import qwen_tokenizer_dir

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


@pytest.fixture(scope="module")
def calculator():
    from rlft.data.prompts import Prompt
    from rlft.envs.registry import make_environment

    return make_environment("calculator", Prompt("chat", answer_format="boxed"))


def test_split_target_cuts_turns_at_their_tool_replies():
    target = SOLUTION.replace("\n#### 72", "\nThe final answer is $\\boxed{72}$.")
    assert split_target(target) == [
        TargetTurn(CALL.format("48 / 2"), ("24",)),
        TargetTurn("Natalia sold 24 clips in May.\n" + CALL.format("48 + 24") + CALL.format("72 * 1"), ("72", "72")),
        TargetTurn("Altogether 72 clips.\nThe final answer is $\\boxed{72}$."),
    ]
    assert split_target("No tools: \\boxed{3}") == [TargetTurn("No tools: \\boxed{3}")]


@pytest.mark.parametrize("target, message", [
    ("I think.\n<tool_response>\n7\n</tool_response>\n\\boxed{7}", "must follow a turn that ends with a tool call"),
    (CALL.format("3 + 4") + "\n<tool_response>\n7\n\\boxed{7}", "is not closed with </tool_response>"),
    (CALL.format("3 + 4") + "\n<tool_response>\n7\n</tool_response>\n", "the model's answer must follow it"),
    ("\\boxed{7}</tool_response>", "a </tool_response> without its <tool_response>"),
    (CALL.format("1") + "<tool_response><tool_response>7</tool_response>x", "opens inside another"),
])
def test_a_target_that_is_not_an_episode_is_one_line(target, message):
    with pytest.raises(TargetError, match=message) as err:
        split_target(target)
    assert "\n" not in str(err.value)


def test_target_tokens_are_the_turns_and_the_templates_replies(tok, calculator):
    from rlft.envs.episodes import reply_token_ids

    start = calculator.open("Natalia sold 48 clips in April and half as many in May. How many in all?", "72")
    target = f"{CALL.format('48 / 2')}\n<tool_response>\n24\n</tool_response>\nSo \\boxed{{72}}"
    ids, mask = target_token_ids(tok, start, target)
    turn1 = tok(CALL.format("48 / 2"), add_special_tokens=False)["input_ids"]
    reply = reply_token_ids(tok, start.messages, start.tools, [{"role": "tool", "content": "24"}])
    turn2 = tok("So \\boxed{72}", add_special_tokens=False)["input_ids"]
    assert (ids, mask) == (turn1 + reply + turn2, [1] * len(turn1) + [0] * len(reply) + [1] * len(turn2))
    assert tok.decode(reply) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n24\n</tool_response><|im_end|>\n"
                                 "<|im_start|>assistant\n")
    # Up to the second turn, prompt + target read as the conversation the chat template writes.
    said = [{"role": "assistant", "content": CALL.format("48 / 2")}, {"role": "tool", "content": "24"}]
    so_far = tok.apply_chat_template([*start.messages, *said], tools=list(start.tools), tokenize=False,
                                     add_generation_prompt=True)
    assert tok.decode(start.token_ids(tok) + ids) == so_far + "So \\boxed{72}"


def sft_rows(tmp_path, tok, environment, rows):
    from conftest import write_gsm8k_dir
    from rlft.data import load_examples
    from rlft.data.prompts import Prompt
    from rlft.roles.sft_data import build_sft_data

    path = write_gsm8k_dir(tmp_path / "d", {"train": []})
    (path / "train.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    examples = load_examples(str(path), "train").examples
    return build_sft_data(examples, tok, template=Prompt("chat", answer_format="boxed"), max_seq_len=4096,
                          end_with_eos=True, environment=environment)


def test_sft_with_the_calculator_trains_the_turns_not_the_replies(tmp_path, tok, calculator):
    from rlft.roles.sft_data import sft_batch

    rows = [("Natalia sold 48 clips in April and half as many in May. How many in all?", SOLUTION),
            ("What is 3 plus 4?", "3 + 4 = 7\n#### 7"),
            ("Broken?", "<tool_response>\n7\n</tool_response>\n#### 7")]
    data = sft_rows(tmp_path, tok, calculator, rows)
    assert len(data) == 2 and data.skipped == {"bad_tool_target": 1}
    # The prompts are the environment's: the calculator is offered.
    assert all('"name": "calculator"' in p for p in data.prompts)
    batch = sft_batch(data, [0, 1], tok, end_with_eos=True)
    (ids0, mask0), (ids1, mask1) = [(row.response_ids, row.response_mask) for row in data.rows]
    assert mask1 == [1] * len(ids1) and ids1[-1] == tok.eos_token_id  # no tool: every target token
    assert mask0.count(0) == len(ids0) - sum(mask0) > 0 and ids0[-1] == tok.eos_token_id
    # The loss reads exactly the model's tokens: label column t is 1 where token t + 1 is one of them.
    assert batch.response_mask.sum(-1).tolist() == [float(sum(mask0)), float(sum(mask1))]
    trained = batch.input_ids[0, 1:][batch.response_mask[0].bool()].tolist()
    assert trained == [t for t, m in zip(ids0, mask0) if m]
    text = tok.decode(trained)
    assert "<tool_response>" not in text and "24\n</tool_response>" not in text and "Natalia sold 24" in text
    assert text.endswith("The final answer is $\\boxed{72}$.<|im_end|>")


def test_sft_without_an_environment_leaves_out_rows_with_tool_replies(tmp_path, tok):
    rows = [("Natalia sold 48 clips in April and half as many in May. How many in all?", SOLUTION),
            ("What is 3 plus 4?", "3 + 4 = 7\n#### 7")]
    data = sft_rows(tmp_path, tok, None, rows)
    assert len(data) == 1 and data.skipped == {"tool_replies": 1} and data.rows[0].response_mask == [1] * len(
        data.rows[0].response_ids)


def test_the_sft_feeder_takes_the_runs_environment(tmp_path, tok):
    from conftest import write_gsm8k_dir
    from rlft.config import load_config
    from rlft.roles.sft_data import SFTFeeder

    data = write_gsm8k_dir(tmp_path / "d", {"train": []})
    rows = [("Natalia sold 48 clips in April and half as many in May. How many in all?", SOLUTION),
            ("What is 3 plus 4?", "3 + 4 = 7\n#### 7")]
    (data / "train.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    overrides = [f"data.source={data}", "data.prompt_template=chat", "reward.answer_format=boxed", "sft.batch_size=2",
                 "optim.train_micro_batch_size=2", "sft.max_seq_len=4096"]
    with_tools = SFTFeeder(load_config(None, [*overrides, "environment.name=calculator"]), tok)
    batch = with_tools.next_batch()
    masks = sorted(sum(row.response_mask) for row in with_tools.data.rows)
    assert sorted(batch.response_mask.sum(-1).tolist()) == masks
    assert sum(len(row.response_ids) for row in with_tools.data.rows) > sum(masks)  # the replies are left out
    # The run without the calculator leaves out the row whose solution holds a tool's reply.
    plain = SFTFeeder(load_config(None, [*overrides, "sft.batch_size=1", "optim.train_micro_batch_size=1"]), tok)
    assert len(plain.data) == 1 and plain.data.skipped == {"tool_replies": 1}
