"""Shared test helpers: where the repository and the GSM8K fixture live, and a tiny model that has
learnt the answer format (so rollouts earn rewards with real variance)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The first 64 train and 32 test rows of openai/gsm8k (MIT; see tests/fixtures/gsm8k/README.md).
GSM8K_FIXTURE = REPO / "tests" / "fixtures" / "gsm8k"


def pytest_collection_modifyitems(session, config, items):
    """The longest files first (`tests/file_costs.py`), each file's tests in their own order: the workers
    start on the long end-to-end files, and the short ones fill in at the end."""
    from file_costs import load

    seconds = load()
    first_seen = {}
    for item in items:
        first_seen.setdefault(item.path.name, len(first_seen))
    items.sort(key=lambda item: (-seconds.get(item.path.name, 0.0), first_seen[item.path.name]))


def rollout_rows(prompt_ids, response_ids, finish_reasons, *, texts=None, ground_truths=None, logprobs=None,
                 response_masks=None, indices=None):
    """Hand-made rollout rows (`rlft.envs.rollouts.RolloutRow`), one per response, from per-row lists."""
    from rlft.data.examples import Example
    from rlft.envs.episodes import EpisodeResult
    from rlft.envs.rollouts import RolloutRow

    n = len(response_ids)
    texts, ground_truths = texts or ["r"] * n, ground_truths or ["1"] * n
    logprobs, indices = logprobs or [None] * n, indices or [0] * n
    masks = response_masks or [[1] * len(ids) for ids in response_ids]
    return [RolloutRow(Example(question=f"q{indices[i]}", ground_truth=ground_truths[i], solution=None,
                               source="test", index=indices[i]),
                       "p", list(prompt_ids[i]),
                       EpisodeResult(token_ids=list(response_ids[i]), response_mask=list(masks[i]), logprobs=logprobs[i],
                                     text=texts[i], finish_reason=finish_reasons[i], num_turns=1))
            for i in range(n)]


def teach_answer_format(model_dir: str | Path, prompts: list[str], answers: list[str], *, steps: int = 100,
                        lr: float = 3e-3, seed: int = 0, output: str = " </think> <answer> {} </answer>",
                        head_on_outputs_only: bool = False, append_eos: bool = False,
                        answered: dict[str, str] | None = None) -> None:
    """Fit a tiny model (in place) to answer every prompt with `output` (by default
    ` </think> <answer> A </answer>`), where A is drawn from `answers` with equal weight: sampling then
    gives a mix of right and wrong answers in the right format.  `head_on_outputs_only`: the same loss,
    with the output head applied at the output's positions only (for a large vocabulary, where the
    head over the prompt's positions costs most of each step).  `append_eos`: each output ends with the
    tokenizer's eos token, learnt too, so the model stops after its answer.  `answered`: more prompts,
    each taught its one answer (as often as a prompt above is taught each of its answers)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlft.batching.batch import tokenize_prompt_and_output
    from rlft.roles.reference import sequence_logprobs

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.set_num_threads(1)
    outputs = [output.format(a) for a in answers]
    P = [p for p in prompts for _ in outputs]
    O = [o for _ in prompts for o in outputs]
    for prompt, answer in (answered or {}).items():
        P += [prompt] * len(outputs)
        O += [output.format(answer)] * len(outputs)
    batch = tokenize_prompt_and_output(P, O, tok, append_eos=append_eos)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    mask = batch.response_mask
    for _ in range(steps):
        if head_on_outputs_only:
            position_ids = (batch.attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            hidden = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 position_ids=position_ids, use_cache=False).last_hidden_state[:, :-1]
            logits = model.lm_head(hidden[mask.bool()]).float()
            logp = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:][mask.bool()][:, None]).squeeze(-1)
            loss = -(logp * mask[mask.bool()]).sum() / mask.sum()
        else:
            logp = sequence_logprobs(model, batch.input_ids, batch.attention_mask)
            loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(model_dir)


def layered(*overrides: str) -> list[str]:
    """``key=value`` overrides with a later one replacing an earlier one of the same key, in the first one's
    place: a test's defaults, then one launch's own settings (the launch scripts refuse a key given twice)."""
    last: dict[str, str] = {}
    for text in overrides:
        last[text.split("=", 1)[0].strip()] = text
    return list(last.values())


def write_gsm8k_dir(path: Path, splits: dict[str, list[tuple[str, str]]]) -> Path:
    """A local GSM8K-layout directory: {split}.jsonl with question / answer (`... #### N`)."""
    path.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        (path / f"{split}.jsonl").write_text(
            "".join(json.dumps({"question": q, "answer": f"It is {a}.\n#### {a}"}) + "\n" for q, a in rows))
    return path


def taught_sums(root: Path, *, teach_steps: int, test_size: int) -> tuple[Path, Path]:
    """A tiny 4-layer model taught to answer "What is a plus b?" with 5 or 7 in the right format,
    and the 8 questions as a GSM8K-layout directory (half of them answered 5, half 7; the first
    `test_size` in the test split): groups mix rewards 0 and 1, so the policy gradient is not zero.
    Returns (model directory, data directory)."""
    from rlft.data.prompts import format_prompt
    from tiny_models import tiny_model_dir

    model = tiny_model_dir(root / "model", family="llama", num_layers=4, tie_word_embeddings=True)
    questions = [f"What is {a} plus {b}?" for a, b in zip(range(1, 9), range(3, 11))]
    teach_answer_format(model, [format_prompt(q, "r1_short") for q in questions], ["5", "7"], steps=teach_steps)
    data = write_gsm8k_dir(root / "gsm8k", {
        "train": [(q, "5" if i % 2 else "7") for i, q in enumerate(questions)],
        "test": [(q, "5") for q in questions[:test_size]]})
    return Path(model), data


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    """The committed GSM8K fixture: a directory holding train.jsonl and test.jsonl."""
    return GSM8K_FIXTURE


@pytest.fixture(scope="session")
def taught_sums_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """`taught_sums` with 100 teaching steps and 4 test questions, built once per test run for every
    module that runs on it, whichever worker asks first (the others wait for it and share it): (model
    directory, data directory), to read only."""
    import os
    import shutil
    import tempfile

    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's, above the workers'
    done = shared / "taught_sums"
    with FileLock(str(done) + ".lock"):
        if not (done / "gsm8k" / "test.jsonl").is_file():
            building = Path(tempfile.mkdtemp(prefix=".taught_sums.", dir=shared))
            taught_sums(building, teach_steps=100, test_size=4)
            shutil.rmtree(done, ignore_errors=True)
            os.replace(building, done)
    return done / "model", done / "gsm8k"
