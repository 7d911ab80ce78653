"""What the launch refuses before any rank starts (rlft.config.preflight through rlft.config.launch_plan): each of
these was found only by the ranks, tens of seconds and many lines later, with an output directory
left behind."""
from __future__ import annotations

import http.server
import json
import time
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "launch" / "configs"
TINY = CONFIGS / "grpo_cpu_tiny.yaml"
# A safetensors file holding no tensor: its 8-byte header length, then the header "{}".
EMPTY_SAFETENSORS = (2).to_bytes(8, "little") + b"{}"
GSM8K = REPO / "tests" / "fixtures" / "gsm8k"


def fake_model(path: Path, chat_template: str | None = None) -> Path:
    """A directory the checks take for a model: config, weights file, tokenizer config."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"num_hidden_layers": 2}')
    (path / "model.safetensors").write_bytes(EMPTY_SAFETENSORS)
    (path / "tokenizer.json").write_text("{}")
    tokenizer = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None:
        tokenizer["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    return path


def refusal(capsys, *args: str, module: str = "rlft.train_grpo", config: Path = TINY) -> str:
    """The one line `rlft.config.launch_plan` refuses the launch with (exit status 2)."""
    from rlft.config.launch_plan import main

    with pytest.raises(SystemExit) as info:
        main(["--module", module, "--config", str(config), *args])
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("rlft: config error: ")
    return line[len("rlft: config error: "):]


def accepted(capsys, *args: str, module: str = "rlft.train_grpo", config: Path = TINY) -> None:
    from rlft.config.launch_plan import main

    main(["--module", module, "--config", str(config), *args])
    assert capsys.readouterr().out.startswith("world=")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


# ---------------------------------------------------------------- a chat prompt without a chat template


def test_a_chat_prompt_for_a_tokenizer_without_a_chat_template(tmp_path, capsys):
    out = tmp_path / "out"
    base = fake_model(tmp_path / "base")
    common = [f"output.dir={out}", f"data.source={GSM8K}", "data.prompt_template=chat"]
    assert refusal(capsys, *common, f"model.path={base}") == (
        f"data.prompt_template: a chat prompt needs a tokenizer with a chat template, and {base}'s tokenizer has none: "
        f"use a text template (e.g. data.prompt_template=r1_zero) for a base model")
    assert not out.exists()
    instruct = fake_model(tmp_path / "instruct", chat_template="{{ messages[0].content }}")
    accepted(capsys, *common, f"model.path={instruct}")
    jinja = fake_model(tmp_path / "jinja")  # transformers 5 saves the template as its own file
    (jinja / "chat_template.jinja").write_text("{{ messages[0].content }}")
    accepted(capsys, *common, f"model.path={jinja}")
    accepted(capsys, f"output.dir={out}", f"data.source={GSM8K}", f"model.path={base}")  # a text template


# ---------------------------------------------------------------- training rows


def test_an_empty_or_too_short_train_jsonl(tmp_path, capsys):
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    model = fake_model(tmp_path / "model")
    common = [f"output.dir={out}", f"model.path={model}", f"data.source={data}"]
    (data / "test.jsonl").write_text((GSM8K / "test.jsonl").read_text())
    (data / "train.jsonl").write_text("")
    assert refusal(capsys, *common) == (
        f"data.source: no usable training rows in {data} [train]: rows need a question (data.fields.question: "
        f"question) and a gold answer (data.fields.gold: answer, read as data.fields.gold_kind gsm8k)")
    assert refusal(capsys, *common, module="rlft.train_sft", config=CONFIGS / "sft_cpu_tiny.yaml").startswith(
        f"data.source: no usable training rows in {data} [train]")
    rows = (GSM8K / "train.jsonl").read_text().splitlines()
    (data / "train.jsonl").write_text(rows[0] + "\n{broken\n")
    assert refusal(capsys, *common) == (
        f"data.train_size: 1 usable training rows in {data} [train] (skipped: invalid_json=1), but every step draws "
        f"optim.rollout_batch_size / grpo.group_size = 2 prompts; raise data.train_size or lower "
        f"optim.rollout_batch_size")
    assert not out.exists()
    (data / "train.jsonl").write_text("\n".join(rows[:2]) + "\n")
    accepted(capsys, *common)


def test_the_ranks_say_the_same_of_a_split_with_no_usable_row(tmp_path):
    from rlft.config import ConfigError, load_config
    from rlft.roles.prompt_source import PromptSource

    (tmp_path / "train.jsonl").write_text("")
    cfg = load_config(TINY, [f"data.source={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^data.source: no usable examples in "):
        PromptSource(cfg, None, 2)


# ---------------------------------------------------------------- a starting checkpoint not made yet


def test_a_missing_init_checkpoint_names_the_sft_config_that_writes_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    demo = CONFIGS / "grpo_cpu_demo.yaml"
    line = refusal(capsys, f"data.source={GSM8K}", config=demo)
    assert line == ("output.init_checkpoint: runs/demo/sft/model does not exist; make it with supervised fine-tuning "
                    "first: `bash launch/sft.sh launch/configs/sft_cpu_demo.yaml` (writes runs/demo/sft/model), or "
                    "point output.init_checkpoint at any HF model (a hub id or a local model directory), or set it to "
                    "null to start from model.path")
    assert "`bash launch/sft.sh launch/configs/sft_1gpu.yaml` (writes runs/sft/model)" in refusal(
        capsys, f"data.source={GSM8K}", "output.init_checkpoint=runs/sft/model", config=demo)
    assert "`bash launch/sft.sh SFT_CONFIG output.dir=elsewhere/sft` (writes elsewhere/sft/model)" in refusal(
        capsys, f"data.source={GSM8K}", "output.init_checkpoint=elsewhere/sft/model", config=demo)
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- hub ids


def test_a_hub_id_not_cached_while_offline(tmp_path, capsys, hub_cache):
    out = tmp_path / "out"
    args = [f"output.dir={out}", f"data.source={GSM8K}", "model.path=org/doesnotexist"]
    assert refusal(capsys, *args) == (
        f"model.path: org/doesnotexist is not in the local Hugging Face cache ({hub_cache}) and HF_HUB_OFFLINE=1 "
        f"keeps it from being downloaded: download it first (`hf download org/doesnotexist`), or give a local "
        f"model directory")
    assert refusal(capsys, f"output.dir={out}", f"data.source={GSM8K}", "output.init_checkpoint=org/sft").startswith(
        "output.init_checkpoint: org/sft is not in the local Hugging Face cache")
    assert not out.exists()
    # Cached: accepted, and a chat prompt reads the snapshot's tokenizer files.
    repo = hub_cache / "models--org--doesnotexist"
    fake_model(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    accepted(capsys, *args)
    assert refusal(capsys, *args, "data.prompt_template=chat").startswith(
        "data.prompt_template: a chat prompt needs a tokenizer with a chat template, and org/doesnotexist's")


class _Hub(http.server.BaseHTTPRequestHandler):
    known = {"/api/models/org/known"}

    def do_HEAD(self):  # noqa: N802 - http.server's name
        self.send_response(200 if self.path in self.known else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_hub_id_the_hub_does_not_know_or_cannot_be_reached(tmp_path, capsys, hub_cache, monkeypatch):
    from rlft.common import free_port

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    common = [f"output.dir={tmp_path / 'out'}", f"data.source={GSM8K}"]
    try:
        accepted(capsys, *common, "model.path=org/known")
        assert refusal(capsys, *common, "model.path=org/unknown") == (
            f"model.path: org/unknown is no model the Hugging Face hub ({endpoint}) knows (HTTP 404): check the id, "
            f"set HF_TOKEN for a private model, or give a local model directory")
    finally:
        server.shutdown()
        server.server_close()
    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("HF_ENDPOINT", closed)
    assert refusal(capsys, *common, "model.path=org/known").startswith(
        f"model.path: org/known is not in the local Hugging Face cache ({hub_cache}) and the hub ({closed}) cannot be "
        f"reached (")


def test_train_sh_refuses_an_unreachable_hub_id_at_once(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"))
    res = subprocess.run(["bash", str(REPO / "launch" / "train.sh"), str(TINY), f"output.dir={out}",
                          f"data.source={GSM8K}", "model.path=org/doesnotexist"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    # One line: no rank started (the launch would announce its ranks first), and nothing was written.
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("rlft: config error: model.path: org/doesnotexist is not in the local Hugging Face cache")
    assert not out.exists()


# ---------------------------------------------------------------- inputs the ranks found only after loading a model


def test_data_that_is_not_there_or_holds_nothing(tmp_path, capsys):
    model = fake_model(tmp_path / "model")
    common = [f"output.dir={tmp_path / 'out'}", f"model.path={model}"]
    assert refusal(capsys, *common, f"data.source={tmp_path / 'nosuch'}") == (
        f"data.source: {tmp_path / 'nosuch'} does not exist (expected a .jsonl/.parquet/.csv file, a dataset directory "
        f"holding train and test splits, a hub id like 'openai/gsm8k', gsm_symbolic or reasoning_gym:TASK)")
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text((GSM8K / "train.jsonl").read_text())
    assert refusal(capsys, *common, f"data.source={data}") == (
        f"data.eval_split: no 'test' split in {data} (expected test.jsonl, test.parquet, test-*.parquet or test.csv); "
        f"it has: train")
    (data / "test.jsonl").write_text("")
    assert refusal(capsys, *common, f"data.source={data}") == (
        f"data.eval_split: the 'test' split of {data} is an empty file ({data / 'test.jsonl'})")
    (data / "test.jsonl").write_text('{"question": "q", "answer": "no final line"}\n{broken\n')
    assert refusal(capsys, *common, f"data.source={data}") == (
        f"data.eval_split: none of the first 1 rows of the 'test' split ({data / 'test.jsonl'}) is a usable problem "
        f"(skipped: no_final_answer=1)")
    (data / "test.jsonl").write_text((GSM8K / "test.jsonl").read_text())
    assert refusal(capsys, *common, f"data.source={data}", "data.eval_split=tset").startswith(
        f"data.eval_split: no 'tset' split in {data} (expected tset.jsonl")
    assert refusal(capsys, *common, f"data.source={data}", "data.train_split=trian").endswith("it has: test, train")
    accepted(capsys, *common, f"data.source={data}")


def test_a_parquet_without_the_question_column_or_rows(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = fake_model(tmp_path / "model")
    data = tmp_path / "data"
    data.mkdir()
    rows = [json.loads(line) for line in (GSM8K / "train.jsonl").read_text().splitlines()]
    pq.write_table(pa.table({"problem": [r["question"] for r in rows], "answer": [r["answer"] for r in rows]}),
                   data / "train.parquet")
    pq.write_table(pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())}),
                   data / "test.parquet")
    common = [f"output.dir={tmp_path / 'out'}", f"model.path={model}", f"data.source={data}"]
    assert refusal(capsys, *common) == (
        f"data.fields.question: {data / 'train.parquet'} has no column 'question'; its columns are: problem, answer")
    assert refusal(capsys, *common, "data.fields.question=problem") == (
        f"data.eval_split: the 'test' split of {data} has no rows ({data / 'test.parquet'})")


def test_a_misspelt_reasoning_gym_task_or_option(tmp_path, capsys):
    common = [f"output.dir={tmp_path / 'out'}", f"model.path={fake_model(tmp_path / 'model')}"]
    assert refusal(capsys, *common, "data.source=reasoning_gym:chian_sum") == (
        "data.source: reasoning_gym refuses task 'chian_sum' with options {} (ValueError: Dataset 'chian_sum' not "
        "registered)")
    assert refusal(capsys, *common, "data.source=reasoning_gym:chain_sum?max_term=2") == (
        "data.source: reasoning_gym refuses task 'chain_sum' with options {'max_term': 2} (TypeError: "
        "ChainSumConfig.__init__() got an unexpected keyword argument 'max_term')")
    accepted(capsys, *common, "data.source=reasoning_gym:chain_sum?max_terms=2")


ENVS = '''
from rlft.envs.base import SingleTurnEnvironment

class Broken(SingleTurnEnvironment):
    def open(self, question, ground_truth):
        raise RuntimeError("no server at localhost:8000")
'''


def test_an_environment_that_cannot_be_built_or_opened(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "rlft_test_preflight_envs.py").write_text(ENVS)
    common = [f"output.dir={tmp_path / 'out'}", f"model.path={fake_model(tmp_path / 'model')}", f"data.source={GSM8K}"]
    assert refusal(capsys, *common, "environment.options={max_calls: 3}") == (
        "environment.options: environment 'single_turn' could not be built (TypeError: "
        "Environment.__init__() got an unexpected keyword argument 'max_calls')")
    assert refusal(capsys, *common, "environment.name=rlft_test_preflight_envs:Broken") == (
        "environment.name: environment 'rlft_test_preflight_envs:Broken': open() failed on a probe question "
        "(RuntimeError: no server at localhost:8000)")


def test_a_model_directory_without_tokenizer_files_or_with_unreadable_weights(tmp_path, capsys):
    common = [f"output.dir={tmp_path / 'out'}", f"data.source={GSM8K}"]
    model = fake_model(tmp_path / "model")
    (model / "tokenizer.json").unlink()
    assert refusal(capsys, *common, f"model.path={model}") == (
        f"model.path: {model} has no tokenizer files (one of tokenizer.json, tokenizer.model, vocab.json, vocab.txt, "
        f"spiece.model, sentencepiece.bpe.model): save the tokenizer with the model (tokenizer.save_pretrained)")
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"<html>Access denied</html>")  # a download that went wrong
    assert refusal(capsys, *common, f"model.path={model}") == (
        f"model.path: the weights in {model} cannot be read: model.safetensors is not a safetensors file (its header "
        f"is cut or missing)")
    (model / "model.safetensors").unlink()
    (model / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00001-of-00002.safetensors"}}')
    assert refusal(capsys, *common, f"model.path={model}") == (
        f"model.path: the weights in {model} cannot be read: model.safetensors.index.json names 1 missing file(s): "
        f"model-00001-of-00002.safetensors")


def test_sft_data_without_a_usable_example(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n"
                                                     for i in range(8)))
    common = [f"output.dir={tmp_path / 'out'}", f"model.path={fake_model(tmp_path / 'model')}", f"data.source={data}",
              "data.fields.gold_kind=plain"]
    assert refusal(capsys, *common, module="rlft.train_sft", config=CONFIGS / "sft_cpu_tiny.yaml") == (
        f"data.source: no usable SFT example in the first 8 rows of {data / 'train.jsonl'} (skipped: no_solution=8); "
        f"rows need a worked solution ending in '#### <number>' (data.fields.gold with data.fields.gold_kind gsm8k "
        f"or boxed)")
    accepted(capsys, *common)  # GRPO needs answers only


def test_weights_and_biases_online_without_credentials(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    common = [f"output.dir={tmp_path / 'out'}", f"model.path={fake_model(tmp_path / 'model')}", f"data.source={GSM8K}",
              "reporting.trackers=[wandb]"]
    assert refusal(capsys, *common, "reporting.wandb_mode=online") == (
        "reporting.wandb_mode: online, but no Weights & Biases credentials here (WANDB_API_KEY or `wandb login`): "
        "log in, or use reporting.wandb_mode=offline and `wandb sync` later")
    accepted(capsys, *common)
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    accepted(capsys, *common, "reporting.wandb_mode=online")


def adapted_rows(tmp_path, monkeypatch, module: str, first: str, rows: int):
    """A data dir of `rows` rows {"n": i} per split and an adapter `module:to_problem` that runs the lines
    `first` and then maps row n to question "qn", gold n; (the data dir, the launch's overrides)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / f"{module}.py").write_text("def to_problem(row):\n" + first +
                                           "    return {'question': f\"q{row['n']}\", 'gold': row['n']}\n")
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"n": n}) + "\n" for n in range(rows)))
    return data, [f"output.dir={tmp_path / 'out'}", f"model.path={fake_model(tmp_path / 'model')}",
                  f"data.source={data}", f"data.adapter={module}:to_problem", "data.fields.gold_kind=plain"]


def test_an_adapter_failing_past_the_first_rows_is_reported_as_itself(tmp_path, capsys, monkeypatch):
    # The first 100 rows are read by the fields' check; before, an adapter raising on row 150 came out as
    # "no usable training rows", sending the user to the wrong place.
    data, common = adapted_rows(tmp_path, monkeypatch, "late_rows", "    if row['n'] == 150:\n"
                                                                    "        raise KeyError('answer')\n", rows=200)
    assert refusal(capsys, *common) == (
        f"data.adapter: late_rows:to_problem raised KeyError: 'answer' on row 150 of {data / 'train.jsonl'}, whose "
        f"fields are: n")


def test_an_output_dir_that_is_a_file_or_under_one(tmp_path, capsys):
    # Before, the launch started every rank, which then failed on making the directory.
    taken = tmp_path / "results.json"
    taken.write_text("{}")
    common = [f"model.path={fake_model(tmp_path / 'model')}", f"data.source={GSM8K}"]
    assert refusal(capsys, *common, f"output.dir={taken}") == (
        f"output.dir: {taken} is a file, not a directory: name a directory for the run")
    assert refusal(capsys, *common, f"output.dir={taken / 'run'}") == (
        f"output.dir: {taken / 'run'} lies under {taken}, which is a file, not a directory")
    assert taken.read_text() == "{}"


def test_a_gguf_file_that_is_no_gguf(tmp_path, capsys):
    page = tmp_path / "model.gguf"
    page.write_bytes(b"<!DOCTYPE html><html>rate limited</html>")  # what a failed download leaves
    assert refusal(capsys, f"output.dir={tmp_path / 'out'}", f"data.source={GSM8K}", f"model.path={page}") == (
        f"model.path: {page} is not a GGUF file (it does not start with 'GGUF', but b'<!DO')")


def test_an_adapter_that_never_returns_is_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    # Before, the launch's own check of the first rows waited on it for ever.
    data, common = adapted_rows(tmp_path, monkeypatch, "stuck_rows", "    import time\n"
                                                                     "    while row['n'] == 3:\n"
                                                                     "        time.sleep(60)\n", rows=50)
    start = time.monotonic()
    assert refusal(capsys, *common, "data.adapter_timeout_s=0.5") == (
        f"data.adapter: stuck_rows:to_problem did not return within 0.5 s (data.adapter_timeout_s) on row 3 of "
        f"{data / 'train.jsonl'}, whose fields are: n")
    assert time.monotonic() - start < 10
    assert not (tmp_path / "out").exists()
