"""Supervised fine-tuning: data preparation, step counts, the init-checkpoint check, and a real
2-rank CPU run through launch/sft.sh (DeepSpeed pipeline on gloo) whose model then starts GRPO."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from rlft.config import ConfigError, load_config
from rlft.data import Example, PromptSampler, load_examples
from rlft.data.prompts import format_prompt, format_sft_target
from rlft.roles.sft_data import SKIP_NO_SOLUTION, SKIP_TOO_LONG, build_sft_data, sft_batch, sft_total_steps
from rlft.runtime.entry import check_init_checkpoint
from rlft.train_sft import check_sft_config
from rlft.train_sft import main as sft_main
from tiny_models import tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = ROOT / "launch" / "configs" / "sft_cpu_tiny.yaml"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    # 2 layers (one per pipeline stage), one head of 64: seconds per step on CPU.
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "llama", num_layers=2, hidden_size=64, num_heads=1,
                          num_kv_heads=1, intermediate_size=128)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _n_tokens(tok, prompt: str, target: str) -> int:
    return len(tok(prompt)["input_ids"]) + len(tok(target, add_special_tokens=False)["input_ids"])


# ====================================================================== data


def _ex(question: str, solution: str | None, index: int) -> Example:
    return Example(question=question, ground_truth="72", solution=solution, source="test", index=index)


NATALIA = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
NATALIA_TARGET = " Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips. </think> <answer> 72 </answer>"


def test_build_sft_data_keeps_fitting_pairs_and_counts_the_rest(tokenizer):
    q = "How many clips did Natalia sell altogether in April and May?"
    examples = [
        _ex(q, NATALIA, 0),
        _ex(q, None, 1),  # no worked solution (a gsm_symbolic row whose solution disagreed)
        _ex(q, "It is many.\n#### many", 2),  # final answer not a number
        _ex(q + " Explain. " * 40, NATALIA, 3),  # the same solution under a much longer prompt
    ]
    n0 = _n_tokens(tokenizer, format_prompt(q), NATALIA_TARGET)
    data = build_sft_data(examples, tokenizer, max_seq_len=n0)  # the limit is inclusive
    assert data.prompts == [format_prompt(q)]
    assert data.targets == [NATALIA_TARGET]
    assert data.num_tokens == [n0]
    assert data.skipped == {SKIP_NO_SOLUTION: 2, SKIP_TOO_LONG: 1}
    assert len(data) == 1

    tighter = build_sft_data(examples, tokenizer, max_seq_len=n0 - 1)
    assert len(tighter) == 0 and tighter.skipped == {SKIP_NO_SOLUTION: 2, SKIP_TOO_LONG: 2}
    assert build_sft_data(examples * 3, tokenizer, max_seq_len=n0).num_tokens == [n0] * 3


def test_sft_batch_masks_exactly_the_target_tokens(tokenizer):
    q1, q2 = "What is 6*7?", "Natalia sold clips to 48 of her friends in April. How many clips?"
    data = build_sft_data([_ex(q1, "6*7 = 42.\n#### 42", 0), _ex(q2, NATALIA, 1)], tokenizer)
    batch = sft_batch(data, [1, 0], tokenizer)
    p = [tokenizer(format_prompt(q))["input_ids"] for q in (q2, q1)]
    targets = (NATALIA_TARGET, " 6*7 = 42. </think> <answer> 42 </answer>")
    t = [tokenizer(x, add_special_tokens=False)["input_ids"] for x in targets]
    T = max(len(a) + len(b) for a, b in zip(p, t))
    assert batch.advantages is None and batch.ref_logprobs is None  # SFT carries no GRPO inputs
    assert batch.input_ids.shape == (2, T) and batch.response_mask.shape == (2, T - 1)
    for row in range(2):
        P, R = len(p[row]), len(t[row])
        assert batch.input_ids[row, :P + R].tolist() == p[row] + t[row]
        assert batch.attention_mask[row].sum() == P + R
        # Label column c predicts token c+1: the target's tokens are labels P-1 .. P+R-2.
        expected = torch.zeros(T - 1)
        expected[P - 1:P + R - 1] = 1
        assert torch.equal(batch.response_mask[row], expected)


@pytest.mark.parametrize("n, batch, epochs, max_steps, steps", [
    (10, 3, 3, None, 9),  # 3 whole batches per epoch; the 10th example waits for a later epoch
    (6, 3, 3, None, 6),
    (6, 3, 1, 5, 5),  # max_steps overrides epochs, running into later epochs
    (3, 3, 2, None, 2),
])
def test_sft_total_steps(n, batch, epochs, max_steps, steps):
    assert sft_total_steps(n, batch, epochs, max_steps) == steps


def test_sft_total_steps_needs_one_whole_batch():
    with pytest.raises(ConfigError, match="sft.batch_size: 4 sequences per step but only 3 usable"):
        sft_total_steps(3, 4, 1, None)


def test_sft_feeder_fits_the_model_and_refuses_data_with_no_usable_example(tokenizer, gsm8k_dir):
    from rlft.roles.sft_data import SFTFeeder

    cfg = load_config(TINY_CONFIG, [f"data.source={gsm8k_dir}", "sft.max_seq_len=100000"])
    rows = load_examples(str(gsm8k_dir), "train", size=cfg.sft.train_size).examples
    # The model's positions cap sft.max_seq_len: a model of 450 positions keeps what max_seq_len=450 keeps.
    feeder = SFTFeeder(cfg, tokenizer, context=450)
    assert feeder.data.prompts == build_sft_data(rows, tokenizer, max_seq_len=450).prompts
    assert len(SFTFeeder(cfg, tokenizer).data) == 10
    # Nothing fits: a config error naming the data and why, not advice about the batch size.
    with pytest.raises(ConfigError) as e:
        SFTFeeder(cfg, tokenizer, context=20)
    assert str(e.value) == (
        f"data.source: no usable SFT example in {gsm8k_dir} [train] (skipped: too_long=10; too_long = prompt + "
        f"target over the model's 20 positions); rows need a worked solution ending in '#### <number>' that fits")


# ====================================================================== config checks


def test_sft_config_defaults_and_ranges():
    s = load_config(None).sft
    assert (s.batch_size, s.epochs, s.max_steps, s.max_seq_len, s.train_size) == (32, 1, None, 1024, None)
    for bad, key in (("sft.epochs=0", "sft.epochs"), ("sft.max_steps=0", "sft.max_steps"),
                     ("sft.batch_size=0", "sft.batch_size"), ("sft.max_seq_len=1", "sft.max_seq_len"),
                     ("sft.train_size=0", "sft.train_size")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [bad])


def test_sft_batch_must_split_into_replicas_and_micro_batches():
    # 4 policy ranks, 2 stages -> 2 replicas; 12 per step -> 6 per replica -> 3 micro-batches of 2.
    topo = ["topology.policy_ranks=[0,1,2,3]", "topology.pipeline_stages=2", "topology.sampler_rank=4",
            "topology.reference_rank=4", "topology.evaluator_rank=4", "optim.train_micro_batch_size=2",
            "optim.rollout_batch_size=16"]
    check_sft_config(load_config(None, topo + ["sft.batch_size=12"]))
    with pytest.raises(ConfigError, match="topology.sampler_rank: SFT keeps its training data on the evaluator's rank; "
                                          "set topology.sampler_rank=4"):
        check_sft_config(load_config(None, topo + ["sft.batch_size=12", "topology.sampler_rank=5",
                                                   "topology.reference_rank=5"]))
    for bs in (10, 13):  # 5 per replica is not whole micro-batches; 13 does not split in two
        with pytest.raises(ConfigError, match=f"sft.batch_size: {bs} must split evenly into 2 data-parallel"):
            check_sft_config(load_config(None, topo + [f"sft.batch_size={bs}"]))


def test_sft_cli_refuses_a_bad_batch_before_launching(capsys):
    # launch/sft.sh runs this check before starting any rank.
    with pytest.raises(SystemExit) as e:
        sft_main(["--check-config", "--config", str(TINY_CONFIG), "sft.batch_size=5", "optim.train_micro_batch_size=2"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "rlft: config error: sft.batch_size: 5 must split evenly into 1 data-parallel replica(s) x micro-batches "
        "of optim.train_micro_batch_size=2")
    for shipped in sorted((ROOT / "launch" / "configs").glob("sft_*.yaml")):
        sft_main(["--check-config", "--config", str(shipped)])


def test_sft_cli_refuses_an_override_given_twice(capsys):
    # launch/sft.sh's first check: before, the last of the two silently won.
    with pytest.raises(SystemExit) as e:
        sft_main(["--check-config", "--config", str(TINY_CONFIG), "sft.batch_size=4", "sft.batch_size=8"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == ("rlft: config error: sft.batch_size: given twice on the command line, "
                                               "as '4' and as '8' (only the last would count): keep one")


def test_check_init_checkpoint(tmp_path, monkeypatch, tiny_model):
    monkeypatch.chdir(tmp_path)
    check_init_checkpoint(None)
    check_init_checkpoint(tiny_model)
    # A hub id: taken from the local cache when it is there; offline and not cached, refused at once.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"^output.init_checkpoint: Qwen/Qwen2.5-Math-1.5B is not in the local"):
        check_init_checkpoint("Qwen/Qwen2.5-Math-1.5B")
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen2.5-Math-1.5B" / "snapshots" / "0123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    check_init_checkpoint("Qwen/Qwen2.5-Math-1.5B")
    with pytest.raises(ConfigError) as e:
        check_init_checkpoint("runs/sft/model")
    msg = str(e.value)
    assert msg.startswith("output.init_checkpoint: runs/sft/model does not exist")
    assert "bash launch/sft.sh launch/configs/sft_1gpu.yaml" in msg and "any HF model" in msg
    # "runs/sft" looks like a hub id, but runs/ is a local directory: a local path was meant.
    (tmp_path / "runs").mkdir()
    with pytest.raises(ConfigError, match="runs/sft does not exist"):
        check_init_checkpoint("runs/sft")
    (tmp_path / "runs" / "half").mkdir()
    (tmp_path / "runs" / "half" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="missing weights.*launch/sft.sh"):
        check_init_checkpoint("runs/half")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="notes.txt is a file"):
        check_init_checkpoint("notes.txt")


# ====================================================================== a real run: launch/sft.sh, 2 CPU ranks

TINY_SFT = load_config(TINY_CONFIG).sft  # 10 rows, <= 450 tokens, 3 per step, 6 steps


def _launch(script: str, config: Path, overrides: list[str], timeout: int = 600):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", str(ROOT / "launch" / script), str(config), *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - t0


def _steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_model, gsm8k_dir):
    out = tmp_path_factory.mktemp("sft") / "run"
    # The decoder layers compiled (model.compile_layers): step 1's loss below is still plain HF's.
    proc, seconds = _launch("sft.sh", TINY_CONFIG, [f"model.path={tiny_model}", f"data.source={gsm8k_dir}",
                                                    f"output.dir={out}", "model.compile_layers=true"])
    print(f"sft.sh ({TINY_SFT.max_steps} steps, 2 ranks): {seconds:.1f} s")
    assert proc.returncode == 0, f"launch/sft.sh failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return out, proc.stdout + proc.stderr


def test_sft_with_no_usable_example_stops_every_rank_with_one_config_error(tmp_path, tiny_model, gsm8k_dir):
    # The data rank finds out after loading; every rank then stops with its error (exit 2), none
    # with a lost connection (exit 1), and nothing is written.
    out = tmp_path / "run"
    proc, _ = _launch("sft.sh", TINY_CONFIG, [f"model.path={tiny_model}", f"data.source={gsm8k_dir}",
                                              f"output.dir={out}", "sft.max_seq_len=10"])
    assert proc.returncode == 2, proc.stderr[-4000:]
    failed = [line for line in proc.stderr.splitlines() if line.startswith("rlft: rank") and " failed: " in line]
    assert failed and all("config error: data.source: no usable SFT example" in x for x in failed), proc.stderr[-4000:]
    assert "sft.max_seq_len=10" in failed[0] and "sft.batch_size" not in proc.stderr
    assert "lost contact" not in proc.stderr
    # Nothing of the run is written; at most the output directory's lock record of the refused launch.
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == [".lock"], sorted(out.iterdir())


def _slice_pairs(tokenizer, gsm8k_dir):
    """The run's training pairs, rebuilt here: the first 10 train rows, those within 450 tokens (each
    target ending with the eos, `sft.end_with_eos`'s default)."""
    rows = load_examples(str(gsm8k_dir), "train", size=TINY_SFT.train_size).examples
    return rows, build_sft_data(rows, tokenizer, max_seq_len=TINY_SFT.max_seq_len, end_with_eos=True)


def _response_nll(model, tokenizer, data, indices) -> float:
    """Token-mean NLL of the target tokens of `indices`, computed with plain transformers."""
    batch = sft_batch(data, indices, tokenizer, end_with_eos=True)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.response_mask
    return float(-(logp * mask).sum() / mask.sum())


def test_sft_run_skips_long_rows_and_lowers_the_loss(sft_run, tokenizer, tiny_model, gsm8k_dir):
    from transformers import AutoModelForCausalLM

    out, logs = sft_run
    rows, data = _slice_pairs(tokenizer, gsm8k_dir)
    # The skipped count, worked out independently: rows longer than 450 tokens with the template.
    too_long = sum(_n_tokens(tokenizer, format_prompt(r.question), format_sft_target(r.solution)) + 1  # + eos
                   > TINY_SFT.max_seq_len for r in rows)
    assert (len(data), too_long) == (6, 4)
    assert "6 pairs from" in logs and "too_long=4" in logs and "2 steps per epoch, 6 steps" in logs
    assert logs.count("model.compile_layers: this stage's") == 2  # both pipeline stages compiled theirs

    steps = _steps(out)
    assert [s["step"] for s in steps if "loss" in s] == [1, 2, 3, 4, 5, 6]
    by_step = {s["step"]: s for s in steps}
    for s in by_step.values():
        assert s["lr"] == pytest.approx(3e-3) and s["grad_norm"] > 0
        assert s["throughput/tokens_per_s"] > 0 and s["time/train"] > 0
    # Step 1 trains on the first batch of epoch 0's seeded order, with the initial weights: its loss
    # is the token-mean NLL of those targets, which plain transformers computes the same.
    first = PromptSampler(len(data), TINY_SFT.batch_size, seed=0).epoch_order(0)[:TINY_SFT.batch_size]
    init = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert by_step[1]["loss"] == pytest.approx(_response_nll(init, tokenizer, data, first), rel=1e-4)
    assert by_step[1]["tokens/response"] == sum(len(tokenizer(data.targets[i], add_special_tokens=False)
                                                    ["input_ids"]) + 1 for i in first)  # + each target's eos
    # Each epoch covers the same 6 pairs: the third epoch's loss is well below the first's.
    epoch1 = (by_step[1]["loss"] + by_step[2]["loss"]) / 2
    epoch3 = (by_step[5]["loss"] + by_step[6]["loss"]) / 2
    assert epoch3 < epoch1 - 0.5, (epoch1, epoch3)


def test_sft_run_writes_checkpoints_eval_and_a_loadable_model(sft_run, tokenizer, tiny_model, gsm8k_dir):
    from transformers import AutoModelForCausalLM

    out, _ = sft_run
    # Checkpoints every 3 steps; the last one holds the data position: 3 epochs of 2 batches done.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000003", "step_000006"]
    state = json.loads((out / "checkpoints" / "step_000006" / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["total_steps"] == 6
    assert (state["prompt_sampler"]["epoch"], state["prompt_sampler"]["position"]) == (2, 6)
    # Evaluation through the evaluator's engine after steps 3 and 6.
    for step in (3, 6):
        summary = json.loads((out / "eval" / f"step_{step:06d}" / "summary.json").read_text())
        assert summary["num_examples"] == 2
    by_step = {s["step"]: s for s in _steps(out)}
    assert 0.0 <= by_step[6]["eval/accuracy"] <= 1.0 and "time/sync" in by_step[6]

    # The HF export: from_pretrained opens it, it is the trained model (the training pairs' NLL fell).
    _, data = _slice_pairs(tokenizer, gsm8k_dir)
    trained = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
    init = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    everything = list(range(len(data)))
    before = _response_nll(init, tokenizer, data, everything)
    after = _response_nll(trained, tokenizer, data, everything)
    assert after < before - 0.5, (before, after)
    assert json.loads((out / "model" / "rlft_state.json").read_text()) == {"step": 6}
    check_init_checkpoint(str(out / "model"))


def test_sft_resumes_mid_epoch_exactly(sft_run, tmp_path, tiny_model, gsm8k_dir):
    """Drop everything after the step-3 checkpoint (mid-epoch: 1 of epoch 1's 2 batches done) and
    launch again: steps 4-6 draw the same batches and reach the same losses and weights."""
    import shutil

    from safetensors.torch import load_file

    first, _ = sft_run
    out = tmp_path / "run"
    shutil.copytree(first, out)
    shutil.rmtree(out / "checkpoints" / "step_000006")
    shutil.rmtree(out / "model")
    state = json.loads((out / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert (state["prompt_sampler"]["epoch"], state["prompt_sampler"]["position"]) == (1, 3)
    proc, seconds = _launch("sft.sh", TINY_CONFIG, [f"model.path={tiny_model}", f"data.source={gsm8k_dir}",
                                                    f"output.dir={out}"])
    print(f"sft.sh (resumed at step 3): {seconds:.1f} s")
    assert proc.returncode == 0, f"launch/sft.sh failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    assert "(step 3)" in proc.stderr and "resuming from" in proc.stderr

    original = {s["step"]: s["loss"] for s in _steps(first) if "loss" in s}
    # The copied records of steps 4-6 were dropped with their checkpoint: one line per step.
    steps = [s for s in _steps(out) if "loss" in s]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    resumed = steps[3:]
    for s in resumed:
        assert s["loss"] == pytest.approx(original[s["step"]], rel=1e-5)
    a = {k: v for f in sorted((first / "model").glob("*.safetensors")) for k, v in load_file(f).items()}
    b = {k: v for f in sorted((out / "model").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_grpo_starts_from_the_sft_model(sft_run, tmp_path, tiny_model, gsm8k_dir):
    """One GRPO step from OUT/model (2 ranks: the 2-stage policy; rank 1 also samples, refers, evaluates)."""
    from safetensors.torch import load_file

    sft_model, _ = sft_run
    sft_model = sft_model / "model"
    out = tmp_path / "grpo"
    proc, seconds = _launch("train.sh", ROOT / "launch" / "configs" / "grpo_cpu_tiny.yaml", [
        f"model.path={tiny_model}", f"data.source={gsm8k_dir}", f"output.dir={out}",
        f"output.init_checkpoint={sft_model}", "schedule.steps=1", "schedule.evaluate_freq=0",
        "data.eval_size=1", "sampling.max_tokens=12", "topology.reference_rank=1", "topology.evaluator_rank=1",
        "topology.sampler_rank=1"])
    print(f"train.sh (1 GRPO step, 2 ranks): {seconds:.1f} s")
    assert proc.returncode == 0, f"launch/train.sh failed ({proc.returncode}):\n{proc.stderr[-6000:]}"

    def weights(d: Path) -> dict:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    init, sft, grpo = weights(Path(tiny_model)), weights(sft_model), weights(out / "model")
    assert set(grpo) == set(sft)
    # GRPO's one small step moved the SFT weights far less than SFT moved the initial ones.
    dist = lambda a, b: sum(float((a[k] - b[k]).norm() ** 2) for k in grpo) ** 0.5  # noqa: E731
    assert dist(grpo, sft) < 0.1 * dist(sft, init)
    assert (out / "config.yaml").read_text().count(str(sft_model)) == 1
