"""Evaluation with the calculator environment: the same episodes as training, the last turn graded, and
the tool figures in the records and the summary -- through the library (rlft.evaluate.scoring), the
evaluator role and `python -m rlft.evaluate`.

A tiny chat model (Qwen2.5's template over a small vocabulary) is taught five scripted episodes, one
per question, so that greedy decoding replays them: a right answer from the tool, a wrong direct
answer, a malformed call answered with an error and then a right answer, a wrong expression and its
wrong result, a right direct answer."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tool_episodes import CALL, script_episode, teach_episodes, tiny_tool_model

# (question, ground truth, the model's turns)
SCRIPT = [
    ("What is 3 plus 4?", "7", [CALL.format("3 + 4"), "\\boxed{7}"]),
    ("What is 2 plus 6?", "8", ["\\boxed{5}"]),
    ("What is 5 plus 4?", "9", [CALL.format("5 x 4"), "\\boxed{9}"]),
    ("What is 6 plus 3?", "9", [CALL.format("6 * 3"), "\\boxed{18}"]),
    ("What is 1 plus 5?", "6", ["\\boxed{6}"]),
]
# What the five episodes make of the figures.
FIGURES = {"accuracy": 3 / 5, "tool_call_rate": 3 / 5, "tool_calls_per_episode": 3 / 5, "tool_errors": 1 / 5,
           "turns_per_episode": 8 / 5, "accuracy_with_tool": 2 / 3, "accuracy_without_tool": 1 / 2}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    from transformers import AutoTokenizer

    from conftest import write_gsm8k_dir
    from rlft.data.prompts import Prompt
    from rlft.envs.registry import make_environment

    root = tmp_path_factory.mktemp("tool_eval")
    model = tiny_tool_model(root)
    tok = AutoTokenizer.from_pretrained(model)
    prompt = Prompt("chat", answer_format="boxed")
    env = make_environment("calculator", prompt)
    rows = [script_episode(env, tok, q, turns) for q, _, turns in SCRIPT]
    teach_episodes(model, rows, steps=100)
    data = write_gsm8k_dir(root / "data", {"test": [(q, gt) for q, gt, _ in SCRIPT]})
    return {"model": model, "tok": tok, "prompt": prompt, "env": env, "rows": rows, "data": data, "root": root}


@pytest.fixture(scope="module")
def engine(taught):
    from rlft.engines.hf_engine import HFEngine

    return HFEngine(taught["model"], dtype="float32", tokenizer=taught["tok"])


def examples():
    from rlft.data import Example

    return [Example(q, gt, None, "script", i) for i, (q, gt, _) in enumerate(SCRIPT)]


def greedy(n: int = 1):
    from rlft.engines.base import SamplingSpec

    return SamplingSpec(n=n, temperature=0.0, max_tokens=MAX_TOKENS, stop=[])


def test_evaluation_plays_episodes_and_adds_the_tool_figures(taught, engine):
    from rlft.evaluate.scoring import evaluate

    records, summary = evaluate(engine, taught["tok"], examples(), spec=greedy(2), k=2,
                                prompt_template=taught["prompt"], environment=taught["env"], max_turns=3,
                                max_episode_tokens=80, progress=False)
    tok = taught["tok"]
    for record, (_, _, turns), (_, response_ids, mask) in zip(records, SCRIPT, taught["rows"]):
        # Greedy replays the taught episode: the whole of it is the transcript, its last turn is graded.
        assert record["transcript"] == tok.decode(response_ids, skip_special_tokens=False)
        assert record["response"] == turns[-1]
        assert record["turns"] == len(turns) and record["finish_reason"] == "eos"
        assert record["tool_calls"] == len(turns) - 1
        counts = {k: record[k] for k in ("turns", "tool_calls", "tool_errors", "finish_reason")}
        assert record["episodes"] == [counts] * 2
        assert record["response_length"] == sum(mask)  # the model's tokens, the tool's reply left out
    assert [r["answer_reward"] for r in records] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert [r["tool_errors"] for r in records] == [0, 0, 1, 0, 0]
    assert "Error: cannot parse '5 x 4' as arithmetic" in records[2]["transcript"]
    assert "<tool_response>\n18\n</tool_response>" in records[3]["transcript"]
    assert {k: summary[k] for k in FIGURES} == pytest.approx(FIGURES)
    assert summary["pass@k"] == pytest.approx(3 / 5)


def test_a_single_turn_environment_answers_as_no_environment(taught, engine):
    from rlft.envs.registry import make_environment
    from rlft.evaluate.scoring import evaluate

    kwargs = dict(spec=greedy(), prompt_template=taught["prompt"], progress=False)
    plain, plain_summary = evaluate(engine, taught["tok"], examples(), **kwargs)
    single, single_summary = evaluate(engine, taught["tok"], examples(), **kwargs,
                                      environment=make_environment("single_turn", taught["prompt"]))
    assert [r["responses"] for r in single] == [r["responses"] for r in plain]
    for summary, records in ((plain_summary, plain), (single_summary, single)):
        assert not set(FIGURES) - {"accuracy"} & set(summary)
        assert all("transcript" not in r for r in records)
    # Without the tools in its prompt the model never gets a tool reply: no episode is replayed.
    assert all("<tool_response>" not in r["response"] for r in plain)


def run_config(taught, out, **environment):
    from rlft.config import load_config

    overrides = [f"model.path={taught['model']}", f"data.source={taught['data']}", "data.prompt_template=chat",
                 "reward.answer_format=boxed", f"sampling.eval_max_tokens={MAX_TOKENS}", f"output.dir={out}",
                 "environment.name=calculator", "environment.max_turns=3", "environment.max_episode_tokens=80",
                 *(f"environment.{k}={v}" for k, v in environment.items())]
    return load_config(None, overrides)


def test_the_evaluator_role_runs_the_runs_environment_unless_told_not_to(taught, engine, tmp_path):
    from rlft.roles.evaluator import Evaluator

    summary = Evaluator(run_config(taught, tmp_path), engine, taught["tok"]).evaluate("with_tools")
    assert {k: summary[k] for k in FIGURES} == pytest.approx(FIGURES)
    written = json.loads((tmp_path / "eval" / "with_tools" / "summary.json").read_text())
    assert written["tool_call_rate"] == pytest.approx(3 / 5)
    lines = (tmp_path / "eval" / "with_tools" / "results.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["tool_calls"] for r in records] == [1, 0, 1, 1, 0]
    without = run_config(taught, tmp_path, evaluate_with_tools="false")
    plain = Evaluator(without, engine, taught["tok"]).evaluate("plain")
    assert "tool_call_rate" not in plain and "accuracy_with_tool" not in plain


def evaluate_cli(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """`python -m rlft.evaluate ARGV` in this process: (status, stdout, stderr)."""
    from rlft.evaluate import cli

    for name in ("VLLM_WORKER_MULTIPROC_METHOD", "VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL"):
        monkeypatch.setenv(name, os.environ.get(name, ""))
        if not os.environ[name]:
            monkeypatch.delenv(name)
    capsys.readouterr()
    status = cli.main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_rlft_evaluate_takes_the_environment_from_the_config(taught, tmp_path, monkeypatch, capsys):
    import yaml

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(run_config(taught, tmp_path / "run").to_dict()))
    base = ["--model", taught["model"], "--data", f"{taught['data']}:test", "--config", str(config), "--backend", "hf",
            "--max-tokens", str(MAX_TOKENS), "--no-progress"]
    status, out, err = evaluate_cli([*base, "--out", str(tmp_path / "tools")], monkeypatch, capsys)
    assert status == 0, err[-3000:]
    summary = json.loads((tmp_path / "tools" / "summary.json").read_text())
    assert {k: summary[k] for k in FIGURES} == pytest.approx(FIGURES)
    assert (summary["environment"], summary["max_turns"], summary["max_episode_tokens"]) == ("calculator", 3, 80)
    assert "episodes with a tool call" in out and "0.6000" in out
    status, _, err = evaluate_cli([*base, "--no-tools", "--out", str(tmp_path / "plain")], monkeypatch, capsys)
    assert status == 0, err[-3000:]
    assert "tool_call_rate" not in json.loads((tmp_path / "plain" / "summary.json").read_text())


@pytest.mark.parametrize("options, message", [
    (["--environment", "abacus"], "--environment: unknown environment 'abacus'"),
    (["--environment", "calculator", "--no-tools"], "--environment and --no-tools: give one of them"),
    (["--environment", "calculator", "--prompt-template", "r1_zero"], "offers tools through the chat template"),
])
def test_rlft_evaluate_refuses_an_unusable_environment_in_one_line(taught, options, message, monkeypatch, capsys):
    argv = ["--model", taught["model"], "--data", f"{taught['data']}:test", "--prompt-template", "chat",
            "--answer-format", "boxed", *options]
    status, _, err = evaluate_cli(argv, monkeypatch, capsys)
    errors = [line for line in err.splitlines() if line.startswith("rlft.evaluate: error:")]
    assert status == 2 and len(errors) == 1 and message in errors[0], err[-2000:]


def test_an_sft_target_is_tokenised_as_the_episode_it_describes(taught, engine):
    """The target an SFT row would hold for each played episode (its turns, the tool's replies in
    <tool_response> blocks) tokenises into the episode's own tokens and model mask."""
    from rlft.envs.episodes import open_episodes, run_episodes
    from rlft.envs.sft_targets import target_token_ids

    env, tok = taught["env"], taught["tok"]
    starts, prompt_ids = open_episodes(env, [q for q, _, _ in SCRIPT], [gt for _, gt, _ in SCRIPT], tok)
    played = run_episodes(engine, prompt_ids, starts, greedy(), tok, env, max_turns=3, max_episode_tokens=80)
    for start, [episode] in zip(starts, played):
        replies = [m["content"] for m in episode.messages if m["role"] == "tool"]
        target = "".join(f"{turn}\n<tool_response>\n{reply}\n</tool_response>\n"
                         for turn, reply in zip(episode.turns, replies)) + episode.turns[-1]
        ids, mask = target_token_ids(tok, start, target)
        assert (ids + [tok.eos_token_id], mask + [1]) == (episode.token_ids, episode.response_mask), target
    assert sum(len(e.turns) > 1 for [e] in played) == 3  # three of them called the tool


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_plays_each_episode_on_without_waiting_and_replays_the_lockstep(taught, engine):
    """On vLLM every episode's next turn joins the running batch as soon as the calculator has answered
    (``continuous_turns``); greedy, that plays the very episodes the turn-by-turn driver plays, on vLLM
    and on the HF engine: the taught ones, token for token, and the same cuts under a tight budget."""
    from rlft.engines import make_engine
    from rlft.envs.episodes import open_episodes, run_episodes

    env, tok = taught["env"], taught["tok"]
    starts, prompt_ids = open_episodes(env, [q for q, _, _ in SCRIPT], [gt for _, gt, _ in SCRIPT], tok)
    vllm = make_engine("vllm", taught["model"], dtype="float32", device="cpu", seed=0,
                       options=dict(max_model_len=max(map(len, prompt_ids)) + 96, kv_cache_memory_bytes=32 << 20))
    try:
        assert vllm.continuous_turns

        def played(eng, budget: int, lockstep: bool = False):
            if lockstep:
                eng.continuous_turns = False
            try:
                groups = run_episodes(eng, prompt_ids, starts, greedy(), tok, env, max_turns=3,
                                      max_episode_tokens=budget)
            finally:
                if lockstep:
                    del eng.continuous_turns  # back to the class's own
            return [[(e.token_ids, e.response_mask, e.turns, e.num_turns, e.tool_calls, e.tool_errors,
                      e.finish_reason) for e in group] for group in groups]

        continuous = played(vllm, 80)
        for group, (_, response_ids, mask) in zip(continuous, taught["rows"]):
            assert [(ids, m) for ids, m, *_ in group] == [(response_ids, mask)]
        assert continuous == played(vllm, 80, lockstep=True) == played(engine, 80)
        # A budget that ends the calling episodes mid-way: the same cuts, "max_tokens" where it bites.
        tight = played(vllm, 30)
        assert tight == played(vllm, 30, lockstep=True) == played(engine, 30)
        assert {e[-1] for group in tight for e in group} >= {"max_tokens", "eos"}
    finally:
        vllm.close()
