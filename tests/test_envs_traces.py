"""Tool traces from GSM8K's calculator annotations (rlft/envs/traces.py): each annotated solution as an
episode of the calculator environment, in Qwen2.5's real chat template, the replies the tool's own and out
of the loss; the same rows without calls for a single-turn arm; the whole training split's count."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlft.data import load_examples
from rlft.data.prompts import Prompt, format_sft_target
from rlft.envs.base import Environment, EpisodeStart, StepResult
from rlft.envs.traces import (
    SKIP_MISMATCH,
    SKIP_TOO_MANY_CALLS,
    SKIP_TOOL_ERROR,
    SKIP_UNREADABLE,
    TraceError,
    agrees,
    solution_transform,
)

FIXTURE = Path(__file__).parent / "fixtures" / "gsm8k"
BOXED = Prompt("chat", answer_format="boxed")
CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
REPLY = "<tool_response>\n{}\n</tool_response>"
# The fixture's first two rows as episodes, written out by hand from their annotated solutions.
NATALIA = (f"Natalia sold 48/2 =\n{CALL.format('48/2')}\n{REPLY.format(24)}\n24 clips in May.\n"
           f"Natalia sold 48+24 =\n{CALL.format('48+24')}\n{REPLY.format(72)}\n"
           "72 clips altogether in April and May.\nThe final answer is $\\boxed{72}$.")
WENG = (f"Weng earns 12/60 = $\n{CALL.format('12/60')}\n{REPLY.format('0.2')}\n0.2 per minute.\n"
        f"Working 50 minutes, she earned 0.2 x 50 = $\n{CALL.format('0.2*50')}\n{REPLY.format(10)}\n10.\n"
        "The final answer is $\\boxed{10}$.")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from tiny_models import qwen_tokenizer_dir

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


@pytest.fixture(scope="module")
def calculator():
    from rlft.envs.registry import make_environment

    return make_environment("calculator", BOXED)


@pytest.fixture(scope="module")
def fixture_rows():
    return load_examples(str(FIXTURE), "train").examples


def target(transform, ex) -> str | None:
    solution, _ = transform(ex.question, ex.ground_truth, ex.solution)
    return None if solution is None else format_sft_target(solution, BOXED)


def test_annotated_fixture_rows_become_the_hand_written_episodes(calculator, fixture_rows):
    transform = solution_transform("tool_calls", calculator, max_turns=10)
    assert target(transform, fixture_rows[0]) == NATALIA
    assert target(transform, fixture_rows[1]) == WENG
    # The row without annotations (29) is an episode that needs no call; stripped, its text is plain.
    plain = solution_transform("plain", None, max_turns=10)
    assert target(transform, fixture_rows[29]) == target(plain, fixture_rows[29])
    assert "<tool_call>" not in target(transform, fixture_rows[29])
    # Every fixture row converts with room for its calls; with 4 turns, rows of more than 3 calls do not.
    assert [transform(e.question, e.ground_truth, e.solution)[1] for e in fixture_rows] == [None] * 64
    short = solution_transform("tool_calls", calculator, max_turns=4)
    reasons = [short(e.question, e.ground_truth, e.solution)[1] for e in fixture_rows]
    assert reasons.count(SKIP_TOO_MANY_CALLS) == 28 and reasons.count(None) == 36


def test_the_episode_tokens_train_the_turns_and_mask_the_tools_replies(tok, calculator, fixture_rows):
    from rlft.envs.episodes import reply_token_ids
    from rlft.envs.sft_targets import target_token_ids

    ex = fixture_rows[0]
    start = calculator.open(ex.question, ex.ground_truth)
    ids, mask = target_token_ids(tok, start, NATALIA)
    turns = [f"Natalia sold 48/2 =\n{CALL.format('48/2')}",
             f"24 clips in May.\nNatalia sold 48+24 =\n{CALL.format('48+24')}",
             "72 clips altogether in April and May.\nThe final answer is $\\boxed{72}$."]
    said1 = [{"role": "assistant", "content": turns[0]}, {"role": "tool", "content": "24"}]
    reply1 = reply_token_ids(tok, start.messages, start.tools, said1[1:])
    reply2 = reply_token_ids(tok, [*start.messages, *said1], start.tools, [{"role": "tool", "content": "72"}])
    t = [tok(x, add_special_tokens=False)["input_ids"] for x in turns]
    assert ids == t[0] + reply1 + t[1] + reply2 + t[2]
    assert mask == [1] * len(t[0]) + [0] * len(reply1) + [1] * len(t[1]) + [0] * len(reply2) + [1] * len(t[2])
    # Up to its last turn, the episode reads as the conversation the chat template writes, replies included.
    messages = [*start.messages, *said1, {"role": "assistant", "content": turns[1]}, {"role": "tool", "content": "72"}]
    so_far = tok.apply_chat_template(messages, tools=list(start.tools), tokenize=False, add_generation_prompt=True)
    assert tok.decode(start.token_ids(tok) + ids) == so_far + turns[2]


@pytest.mark.parametrize("annotation, reason", [
    ("<<48/2=25>>", SKIP_MISMATCH),  # the tool says 24: the annotation is wrong, the row is left out
    ("<<48/0=24>>", SKIP_TOOL_ERROR),  # division by zero: the tool answers an error
    ("<<48 apples/2=24>>", SKIP_TOOL_ERROR),
    ("<<48/2>>", SKIP_UNREADABLE),  # no '=' between expression and result
])
def test_a_row_the_tool_does_not_reproduce_is_skipped_with_its_reason(calculator, annotation, reason):
    solution = f"Natalia sold 48/2 = {annotation}24 clips in May.\n#### 24"
    for form in ("tool_calls", "plain_checked"):
        transform = solution_transform(form, calculator if form == "tool_calls" else None, max_turns=4)
        assert transform("q", "24", solution) == (None, reason)


def test_the_reply_is_the_tools_never_the_annotations(calculator):
    # The annotation rounds 2/3 to 0.67; the tool's reply is its own 10 significant digits.
    transform = solution_transform("tool_calls", calculator, max_turns=4)
    solution, reason = transform("q", "1", "Each gets 2/3 = <<2/3=0.67>>0.67 of a pie.\n#### 0.67")
    assert reason is None and REPLY.format("0.6666666667") in solution and "0.67>>" not in solution
    assert agrees("33.3333333333", "33.33") and agrees("24", "24.0") and not agrees("24", "25")
    assert not agrees("Error: division by zero", "0")
    # plain_checked keeps the solution itself (format_sft_target strips the annotations later).
    checked = solution_transform("plain_checked", None, max_turns=4)
    assert checked("q", "1", "2/3 = <<2/3=0.67>>0.67\n#### 0.67") == ("2/3 = <<2/3=0.67>>0.67\n#### 0.67", None)


def sft_data(tok, examples, form, environment, max_turns=10):
    from rlft.roles.sft_data import build_sft_data

    return build_sft_data(examples, tok, template=BOXED, max_seq_len=4096, end_with_eos=True,
                          environment=environment, transform=solution_transform(form, environment, max_turns))


def test_sft_pairs_with_calls_and_without_are_the_same_solutions(tok, calculator, fixture_rows):
    rows = fixture_rows[:8]
    bad = type(rows[0])(rows[0].question, "72", rows[0].solution.replace("=24>>", "=23>>"), "t", 99)
    tools = sft_data(tok, [*rows, bad], "tool_calls", calculator)
    single = sft_data(tok, [*rows, bad], "plain_checked", None)
    assert len(tools) == len(single) == 8 and tools.skipped == single.skipped == {SKIP_MISMATCH: 1}
    assert tools.targets[0] == NATALIA and tools.targets[1] == WENG
    assert single.targets[0] == ("Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether "
                                 "in April and May.\nThe final answer is $\\boxed{72}$.")
    assert all("<tool_call>" not in t and "<<" not in t for t in single.targets)
    # Every annotation of the eight rows is one masked reply in the tool arm: the turns are trained, the
    # replies never; the single-turn arm trains every target token.
    calls = sum(t.count("<tool_call>") for t in tools.targets)
    assert calls == sum(s.solution.count("<<") for s in rows) == 25
    for row, text in zip(tools.rows, tools.targets):
        trained = tok.decode([i for i, m in zip(row.response_ids, row.response_mask) if m])
        assert "<tool_response>" not in trained and trained.count("<tool_call>") == text.count("<tool_call>")
        assert trained.endswith("$.<|im_end|>")


def test_a_users_annotated_data_through_data_fields(tmp_path, tok, calculator):
    from rlft.data.rows import RowMapping

    row = {"problem": "Tom has 3 bags of 4 apples and eats 2. How many are left?",
           "worked": "Tom has 3*4 = <<3*4=12>>12 apples.\nHe has 12-2 = <<12-2=10>>10 left.\n#### 10"}
    (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n")
    loaded = load_examples(str(tmp_path), "train", rows=RowMapping(question="problem", gold="worked"))
    data = sft_data(tok, loaded.examples, "tool_calls", calculator)
    assert data.targets == [f"Tom has 3*4 =\n{CALL.format('3*4')}\n{REPLY.format(12)}\n12 apples.\n"
                            f"He has 12-2 =\n{CALL.format('12-2')}\n{REPLY.format(10)}\n10 left.\n"
                            "The final answer is $\\boxed{10}$."]


def test_the_solution_form_is_checked_before_any_rank_starts():
    from rlft.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="sft.solution_form: tool_calls writes tool calls, which need a multi-turn"):
        load_config(None, ["sft.solution_form=tool_calls"])
    with pytest.raises(ConfigError, match="sft.solution_form: must be one of plain, tool_calls, plain_checked"):
        load_config(None, ["sft.solution_form=calls"])
    cfg = load_config(None, ["sft.solution_form=tool_calls", "environment.name=calculator", "data.prompt_template=chat"])
    assert cfg.sft.solution_form == "tool_calls"


class NoTools(Environment):
    """A multi-turn environment that offers no tool."""

    def open(self, question, ground_truth):
        return EpisodeStart(messages=tuple(self.prompt.chat_messages(question)))

    def step(self, state, text):
        return StepResult.end()


def test_an_environment_without_a_tool_to_call_is_one_line():
    with pytest.raises(TraceError, match="^sft.solution_form: the environment offers no tool taking one required "
                                         "argument") as err:
        solution_transform("tool_calls", NoTools(BOXED), max_turns=4)
    assert "\n" not in str(err.value)
    assert solution_transform("plain_checked", NoTools(BOXED), max_turns=4)("q", "1", "1+0 = <<1+0=1>>1\n#### 1")[1] is None


def test_sft_with_such_an_environment_stops_with_one_config_error(tok):
    from rlft.config import ConfigError, load_config
    from rlft.roles.sft_data import SFTFeeder

    cfg = load_config(None, [f"data.source={FIXTURE}", "data.prompt_template=chat", "reward.answer_format=boxed",
                             "environment.name=test_envs_traces:NoTools", "sft.solution_form=tool_calls",
                             "sft.batch_size=2"])
    with pytest.raises(ConfigError, match="^sft.solution_form: the environment offers no tool"):
        SFTFeeder(cfg, tok)


def test_full_gsm8k_train_converts_every_annotated_row(tok, calculator):
    value = os.environ.get("RLFT_GSM8K_DIR")
    if not value:
        pytest.skip("full-size check: set RLFT_GSM8K_DIR to a full GSM8K copy (the fixture covers the rest)")
    examples = load_examples(value, "train").examples
    transform = solution_transform("tool_calls", calculator, max_turns=10)
    results = [transform(e.question, e.ground_truth, e.solution) for e in examples]
    assert len(examples) == 7473 and [r for _, r in results if r is not None] == []
    with_calls = sum("<tool_call>" in s for s, _ in results)
    assert with_calls == 7378  # the 95 others carry no annotation: episodes without a call
    assert sum(s.count("<tool_call>") for s, _ in results) == sum(e.solution.count("<<") for e in examples)


def test_a_tiny_cpu_sft_on_the_traces_through_launch_sft_sh(tmp_path):
    """launch/sft.sh, 2 CPU ranks (sft_cpu_tiny.yaml's layout), on the fixture's first 10 rows as calculator
    episodes: step 1's loss is plain transformers' NLL of the model's tokens of its batch, the replies out."""
    import subprocess

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlft.data import PromptSampler
    from rlft.roles.sft_data import build_sft_data, sft_batch
    from tool_episodes import tiny_tool_model

    root = Path(__file__).resolve().parents[1]
    model, out = tiny_tool_model(tmp_path / "model"), tmp_path / "run"
    overrides = [f"model.path={model}", f"data.source={FIXTURE}", f"output.dir={out}", "data.prompt_template=chat",
                 "reward.answer_format=boxed", "environment.name=calculator", "environment.max_turns=10",
                 "environment.max_episode_tokens=64", "sft.solution_form=tool_calls", "sft.max_steps=2",
                 "schedule.evaluate_freq=0", "schedule.save_every=0"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "RLFT_PROGRESS": "0"}
    proc = subprocess.run(["bash", str(root / "launch" / "sft.sh"), str(root / "launch" / "configs" / "sft_cpu_tiny.yaml"),
                           *overrides], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    logs = proc.stdout + proc.stderr
    # Of the first 10 rows, 6 episodes fit sft_cpu_tiny.yaml's 450 tokens (prompt + episode, worked out with
    # this tokenizer: 224, 182, 333, 418, 228 and 379; the others 537 to 782).
    assert "6 pairs from" in logs and "too_long=4" in logs, logs[-3000:]
    tok = AutoTokenizer.from_pretrained(model)
    from rlft.envs.registry import make_environment

    calculator = make_environment("calculator", BOXED)
    rows = load_examples(str(FIXTURE), "train", size=10).examples
    data = build_sft_data(rows, tok, template=BOXED, max_seq_len=450, end_with_eos=True, environment=calculator,
                          transform=solution_transform("tool_calls", calculator, 10))
    assert len(data) == 6
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    step1 = next(s for s in steps if s["step"] == 1 and "loss" in s)
    first = PromptSampler(len(data), 3, seed=0).epoch_order(0)[:3]
    batch = sft_batch(data, first, tok, end_with_eos=True)
    assert step1["tokens/response"] == sum(sum(data.rows[i].response_mask) for i in first)  # the model's tokens only
    init = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        logits = init(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    assert step1["loss"] == pytest.approx(float(-(logp * batch.response_mask).sum() / batch.response_mask.sum()),
                                          rel=1e-4)
    # The final evaluation played calculator episodes and logged the tool figures.
    summary = json.loads(next((out / "eval").glob("step_*/summary.json")).read_text())
    assert {"tool_call_rate", "well_formed_rate", "tool_error_rate", "void_turn_rate"} <= set(summary)
