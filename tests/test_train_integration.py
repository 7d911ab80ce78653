"""The GRPO runtime end to end on CPU: `launch/train.sh` -> the deepspeed launcher -> 4 ranks on gloo.

Layout (launch/configs/grpo_cpu_tiny.yaml): ranks 0-1 a 2-stage policy pipeline, rank 2 the
reference + evaluator, rank 3 the sampler.  One module-scoped run of 3 steps, then a resumed run
to step 4, then checks on what they wrote.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "launch" / "configs" / "grpo_cpu_tiny.yaml"


def launch(*overrides: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, RLFT_PROGRESS="0", **(env or {}))
    return subprocess.run(["bash", str(REPO / "launch" / "train.sh"), str(CONFIG), *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


# The policy on rank 0, the sampler, reference and evaluator on rank 1: for the checks that need no
# pipeline of several stages (the 4-rank layout is tiny_run's).
TWO_RANKS = ("topology.policy_ranks=[0]", "topology.pipeline_stages=1", "topology.sampler_rank=1",
             "topology.reference_rank=1", "topology.evaluator_rank=1")


def read_steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def taught(taught_sums_dirs):
    """(model, data) of the runs here: the tiny model taught the sums, and their questions."""
    return taught_sums_dirs


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, taught):
    root = tmp_path_factory.mktemp("grpo")
    model, data = taught
    out = root / "run"
    common = (f"model.path={model}", f"data.source={data}", f"output.dir={out}",
              "sampling.repetition_penalty=1.0",  # the taught answer repeats prompt tokens
              "data.prompt_template=r1_short")
    t0 = time.time()
    first = launch(*common, "schedule.steps=3")
    first_s = time.time() - t0
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-6000:]
    steps_after_first = read_steps(out)
    t0 = time.time()
    second = launch(*common, "schedule.steps=4")
    second_s = time.time() - t0
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-6000:]
    print(f"\nCPU wall time: first launch (3 steps) {first_s:.1f} s, resumed launch (1 step) {second_s:.1f} s")
    return {"root": root, "model": Path(model), "data": data, "out": out, "first": first, "second": second,
            "steps_after_first": steps_after_first, "common": common}


def test_tensorboard_holds_the_step_scalars(tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tiny_run["out"] / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {"reward/mean", "reward/format", "reward/answer", "loss", "pg_loss", "kl", "entropy",
                "clip_fraction", "grad_norm", "lr", "response_length/mean", "time/sample", "time/grade",
                "time/reference", "time/train", "time/sync", "time/eval", "time/step",
                "throughput/tokens_per_s", "memory/peak_gb", "eval/accuracy", "eval/format_rate"}
    assert expected <= tags, sorted(expected - tags)
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4]
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [2, 3, 4]  # every 2 steps + after the last
    lr = acc.Scalars("lr")[0].value
    assert lr == pytest.approx(1e-5)


def test_rollouts_earn_mixed_rewards(tiny_run):
    steps = read_steps(tiny_run["out"])
    assert all(s["reward/format"] > 0 for s in steps)
    assert 0 < sum(s["reward/mean"] for s in steps) / len(steps) < 1
    # A group whose rewards differ gives the policy a gradient; when every group is uniform the
    # advantages are all zero and only the (tiny) KL term remains.
    for s in steps:
        if s["batch/zero_variance_group_fraction"] < 1:
            assert s["grad_norm"] > 1e-2, s
        else:
            assert s["grad_norm"] < 1e-2, s
    assert any(s["batch/zero_variance_group_fraction"] < 1 for s in steps)


def test_a_single_turn_steps_tokens_are_its_prompts_and_what_was_sampled(tiny_run):
    for s in read_steps(tiny_run["out"]):
        assert s["tokens/inserted"] == 0 and s["tokens/prompt"] + s["tokens/generated"] == s["tokens/total"], s
        # the loss reads the sampled tokens but eos (grpo.train_on_eos: false)
        assert 0 < s["tokens/response"] <= s["tokens/generated"], s


def test_kl_and_entropy_are_real_numbers(tiny_run):
    steps = read_steps(tiny_run["out"])
    # Step 1: the policy still equals the reference, so KL is 0; after the first step with a
    # gradient the policy has moved away from it.
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-7)
    moved = [cur["kl"] for prev, cur in zip(steps, steps[1:]) if prev["grad_norm"] > 1e-2]
    assert moved and all(kl > 0 for kl in moved)
    assert all(s["entropy"] > 0 for s in steps)
    # On-policy, one epoch per rollout: ratio exactly 1, nothing clipped.
    assert all(s["clip_fraction"] == 0 and s["ratio_mean"] == pytest.approx(1.0) for s in steps)


def test_sampler_and_trainer_logprobs_agree(tiny_run):
    # Same fp32 weights on both sides (synced every step): the mismatch is float noise, measured
    # over the two micro-batches of the 2-stage pipeline, on the steps that ask the sampler for
    # log-probs (grpo.mismatch_metrics_every: 2 -> steps 1 and 3); steps 2 and 4 sample without them.
    steps = read_steps(tiny_run["out"])
    assert [s["step"] for s in steps if "rollout_mismatch/kl" in s] == [1, 3]
    for s in steps:
        if s["step"] in (2, 4):
            assert not any(k.startswith("rollout_mismatch/") for k in s)
            continue
        assert abs(s["rollout_mismatch/kl"]) < 1e-6, s  # k3 >= 0 per token; micro-batch sums round
        assert abs(s["rollout_mismatch/ratio_mean"] - 1) < 1e-4
        assert s["rollout_mismatch/ratio_min"] <= s["rollout_mismatch/ratio_mean"] <= s["rollout_mismatch/ratio_max"]
        assert s["rollout_mismatch/ratio_max"] < 1.001 and s["rollout_mismatch/capped_fraction"] == 0
        assert not any(k.startswith("overlong/") for k in s)


def test_sampler_weights_equal_policy_after_every_sync(tiny_run):
    for s in read_steps(tiny_run["out"]):
        assert s["sync/engine_sum"] == pytest.approx(s["sync/policy_sum"], rel=1e-9, abs=1e-9)
        assert s["sync/engine_abs_sum"] == pytest.approx(s["sync/policy_abs_sum"], rel=1e-9)
        # The sampler's rank says where the sync's time went; the parts fit inside the phase.
        parts = s["time/sync/wake"] + s["time/sync/load"] + s["time/sync/checksum"]
        assert 0 < parts <= s["time/sync"] + 1e-3, s


def test_hf_export_loads_and_moved_from_the_start(tiny_run):
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(tiny_run["out"] / "model")
    start = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    diffs = {n: (p - start.state_dict()[n]).abs().max().item() for n, p in trained.state_dict().items()}
    assert max(diffs.values()) > 0
    assert diffs["model.embed_tokens.weight"] > 0 and diffs["model.layers.3.mlp.down_proj.weight"] > 0
    # Tied embeddings stay tied in the export.
    assert trained.lm_head.weight.data_ptr() == trained.model.embed_tokens.weight.data_ptr()
    # The export equals the newest checkpoint's.
    ck = tiny_run["out"] / "checkpoints" / "step_000004" / "hf"
    again = AutoModelForCausalLM.from_pretrained(ck)
    for n, p in again.state_dict().items():
        assert torch.equal(p, trained.state_dict()[n]), n


def test_resume_continues_with_the_same_next_batch(tiny_run):
    from rlft.data import PromptSampler

    steps = read_steps(tiny_run["out"])
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert steps[:3] == tiny_run["steps_after_first"]
    assert "resuming from" in tiny_run["second"].stderr and "(step 3)" in tiny_run["second"].stderr
    # The data position survived the restart: step 4 drew the sampler's 4th batch.
    expected = PromptSampler(8, 2, seed=0)
    batches = [expected.next_batch() for _ in range(4)]
    assert [s["prompt_indices"] for s in steps] == batches
    # Only the newest complete checkpoints are kept, none half-written.
    names = sorted(p.name for p in (tiny_run["out"] / "checkpoints").iterdir())
    assert names == ["step_000003", "step_000004"]
    # The sampler's record keeps the data position where checkpoints always held it (so older ones resume):
    # trainer_state.json's prompt_sampler: the position of the order that drew those 4 batches.
    ck = tiny_run["out"] / "checkpoints" / "step_000004"
    state = json.loads((ck / "trainer_state.json").read_text())["prompt_sampler"]
    assert (state["epoch"], state["position"]) == (expected.epoch, expected.position)
    assert not (ck / "roles").exists()


FAILING_ENVIRONMENT = '''
import os

from rlft.envs.base import SingleTurnEnvironment


class FailsOnRankOne(SingleTurnEnvironment):
    """The single-turn environment, except on the launch's rank 1 (the launch's own checks, which run
    before any rank starts, see one that works)."""

    def open(self, question, ground_truth):
        if os.environ.get("RANK") == "1":
            raise RuntimeError("nosuch: no episode can be opened on this rank")
        return super().open(question, ground_truth)
'''


def test_a_failing_rank_stops_the_whole_launch(tiny_run, tmp_path):
    # Only rank 1 (the sampler's) fails, building its environment after the launch's checks passed; the
    # policy waits for the sampler on the bridge and must not hang there.
    (tmp_path / "failing_env.py").write_text(FAILING_ENVIRONMENT)
    t0 = time.time()
    res = launch(f"model.path={tiny_run['model']}", f"data.source={tiny_run['data']}",
                 "environment.name=failing_env:FailsOnRankOne", f"output.dir={tmp_path / 'out'}", *TWO_RANKS,
                 timeout=300, env={"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"})
    took = time.time() - t0
    assert res.returncode != 0
    failed = [line for line in res.stderr.splitlines() if line.startswith("rlft: rank") and " failed: " in line]
    assert len(failed) == 1 and failed[0].startswith("rlft: rank 1 (sampler + reference + evaluator) failed: "), (
        failed, res.stderr[-3000:])
    assert "nosuch" in failed[0]
    # The policy says why it stops (it lost contact, or the launcher's SIGTERM came first) and names the
    # failed rank, instead of repeating a transport error.
    stopped = [line for line in res.stderr.splitlines() if line.startswith("rlft: rank 0 (") and " stopping: " in line]
    assert len(stopped) == 1 and "rank 1 (sampler + reference + evaluator) failed" in stopped[0], res.stderr[-3000:]
    assert took < 120
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_vllm_backend_runs_the_same_topology(tiny_run, tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "vllm_run"
    # The evaluator shares the sampler's rank (and so its vLLM engine): one engine start, not two.
    # `auto` becomes vLLM here (installed, a CPU build, and the tiny model's head size is one its CPU
    # attention runs): settled once at start for every rank, and the saved config names it.
    res = launch(*tiny_run["common"][:2], f"output.dir={out}", *tiny_run["common"][3:],
                 "sampling.backend=auto", "topology.evaluator_rank=3",
                 "schedule.steps=2", "schedule.save_every=0", timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "VLLMEngine" in res.stderr and "rollout backend auto -> vllm" in res.stderr
    assert yaml.safe_load((out / "config.yaml").read_text())["sampling"]["backend"] == "vllm"
    steps = read_steps(out)
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        # vLLM on CPU repacks weights for its kernels; the checksum reads them back through them.
        assert s["sync/engine_sum"] == pytest.approx(s["sync/policy_sum"], rel=1e-5, abs=1e-4)
        assert s["sync/engine_abs_sum"] == pytest.approx(s["sync/policy_abs_sum"], rel=1e-6)
        assert s["reward/format"] > 0
        # the sync's parts on the sampler's rank, each within the part it belongs to
        assert 0 < s["time/sync/load_finish"] < s["time/sync/load"]
        assert 0 < s["time/sync/checksum_engine"] <= s["time/sync/checksum"]
        # the policy's own sum, on its rank, within that rank's sync (the merged phase is the longest rank's)
        assert 0 < s["time/sync/checksum_policy"] <= s["time/sync"]
        assert not any(k.startswith("time/sync/checksum_policy/") for k in s)
    assert (out / "model" / "config.json").is_file()


def test_async_sampler_works_ahead_and_a_resumed_run_keeps_the_prompt_order(tiny_run, tmp_path):
    """The sampler on its own rank collects step t+1's batch while the policy trains on step t's.
    Staleness is 0 for the first batch and 1 after; the ratio moves away from 1 on stale batches;
    the prompt order is the on-policy run's, also after resuming from a checkpoint taken while a
    batch was waiting (its prompts are drawn again)."""
    from rlft.data import PromptSampler

    common = (*tiny_run["common"][:2], *tiny_run["common"][3:], "schedule.max_staleness=1", "optim.lr=1e-3",
              "schedule.evaluate_freq=0", "schedule.save_every=2", "topology.policy_ranks=[0]",
              "topology.pipeline_stages=1", "topology.reference_rank=0", "topology.evaluator_rank=0",
              "topology.sampler_rank=1")
    first = tmp_path / "ahead"
    res = launch(*common, f"output.dir={first}", "schedule.steps=3")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    steps = read_steps(first)
    expected = PromptSampler(8, 2, seed=0)
    order = [expected.next_batch() for _ in range(4)]
    assert [s["prompt_indices"] for s in steps] == order[:3]
    assert [s["rollout/staleness"] for s in steps] == [0.0, 1.0, 1.0]
    # Step 1 is on-policy: sampler and trainer agree but for kernel noise (fp32 on CPU).
    assert abs(steps[0]["ratio_max"] - 1) < 1e-3
    # A stale batch whose sampling weights the previous step's update has since moved (a non-zero
    # gradient: policy gradient or the KL term): the ratio is not 1, and the logged sampler-trainer
    # mismatch shows the staleness.
    moved = [s for before, s in zip(steps, steps[1:]) if before["grad_norm"] > 0]
    assert moved, steps
    for s in moved:
        assert s["ratio_max"] > 1 + 1e-3 or abs(s["ratio_mean"] - 1) > 1e-3, s
        assert s["rollout_mismatch/kl"] > 1e-4, s

    # Resume from step 2's checkpoint, saved while step 3's batch waited in the queue.
    second = tmp_path / "resumed"
    res = launch(*common, f"output.dir={second}", "schedule.steps=4",
                 f"output.resume={first / 'checkpoints' / 'step_000002'}")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    resumed = read_steps(second)
    assert [s["step"] for s in resumed] == [3, 4]
    assert [s["prompt_indices"] for s in resumed] == order[2:4]
    assert [s["rollout/staleness"] for s in resumed] == [0.0, 1.0]


def test_dynamic_sampling_sizes_its_rounds_from_the_keep_rate_and_a_resumed_run_draws_the_same(tiny_run, tmp_path):
    """grpo.dynamic_sampling with grpo.oversample: auto through the launch: the first round of the run draws
    the step's prompts, later ones as many as the keep rate of the rounds so far asks; every prompt comes
    from the uniform order in turn (a round's leftovers wait for the next); a run resumed from a checkpoint
    draws what the uninterrupted one drew, round for round."""
    from rlft.data import PromptSampler

    common = (*tiny_run["common"][:2], *tiny_run["common"][3:], *TWO_RANKS, "grpo.dynamic_sampling=true",
              "grpo.oversample=auto", "schedule.evaluate_freq=0", "schedule.save_every=2", "optim.lr=1e-3",
              "output.keep_checkpoints=0")
    first = tmp_path / "whole"
    res = launch(*common, f"output.dir={first}", "schedule.steps=4")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    steps = read_steps(first)
    order = PromptSampler(8, 2, seed=0)
    stream = [i for _ in range(64) for i in order.next_batch()]
    assert steps[0]["dynamic_sampling/groups_first_round"] == 2  # no keep rate yet: the step's 2 prompts
    drawn = 0
    for s in steps:
        generated = int(s["dynamic_sampling/groups_generated"])
        # The step trains on its 2 groups, taken from the prompts its rounds drew, in the order's turn.
        window = stream[drawn:drawn + generated]
        assert len(s["prompt_indices"]) == 2 and all(i in window for i in s["prompt_indices"]), (s, window)
        drawn += generated
        assert 0 <= s["dynamic_sampling/keep_rate"] <= 1
    # Groups were sometimes kept and sometimes not, so some round drew more than the prompts it missed.
    assert 0 < steps[-1]["dynamic_sampling/keep_rate"] < 1, steps
    assert any(s["dynamic_sampling/groups_first_round"] > 2 for s in steps[1:]), steps

    resumed_dir = tmp_path / "resumed"
    res = launch(*common, f"output.dir={resumed_dir}", "schedule.steps=4",
                 f"output.resume={first / 'checkpoints' / 'step_000002'}")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    resumed = read_steps(resumed_dir)
    assert [s["step"] for s in resumed] == [3, 4]
    keys = ("prompt_indices", "dynamic_sampling/groups_first_round", "dynamic_sampling/groups_generated",
            "dynamic_sampling/keep_rate", "reward/mean")
    assert [[s[k] for k in keys] for s in resumed] == [[s[k] for k in keys] for s in steps[2:]]


# A reward function a user might write: 1 when the response holds a 7, else 0.25.
SEVEN_REWARD = '''
def reward(response, ground_truth):
    return 1.0 if "7" in response else 0.25
'''


def logged_samples(out: Path) -> dict[int, list[tuple[float, str]]]:
    """(reward, response) of every completion logged to TensorBoard's text tab, by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    found = {}
    for event in acc.Tensors("samples/text_summary"):
        rows = []
        for part in event.tensor_proto.string_val[0].decode().split("\n\n---\n\n"):
            header, _question, block = part.split("\n\n", 2)
            reward = float(header.split()[1])
            rows.append((reward, block.removeprefix("    <think>").replace("\n    ", "\n")))
        found[event.step] = rows
    return found


@pytest.fixture(scope="module")
def custom_reward_run(tmp_path_factory, taught):
    """Two ranks, 2 steps with the user's reward.fn (and TIS, overlong filtering, two epochs per rollout,
    step 2 profiled): (output directory, its launch's overrides and environment, the launch's result)."""
    root = tmp_path_factory.mktemp("custom_reward")
    module_dir = root / "user_rewards"
    module_dir.mkdir()
    (module_dir / "seven_reward.py").write_text(SEVEN_REWARD)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(module_dir), os.environ.get("PYTHONPATH")) if p)}
    out = root / "run"
    model, data = taught
    args = (f"model.path={model}", f"data.source={data}", f"output.dir={out}", "sampling.repetition_penalty=1.0",
            "data.prompt_template=r1_short", *TWO_RANKS,
            "reward.fn=seven_reward:reward", "schedule.steps=2", "schedule.save_every=0",
            "schedule.evaluate_freq=0", "schedule.log_samples_every=1", "schedule.num_logged_samples=4",
            "grpo.rollout_is=tis", "grpo.overlong=filter", "grpo.epochs_per_rollout=2", "optim.lr=1e-3",
            "schedule.profile_steps=[2]")
    return out, args, env, launch(*args, env=env)


def test_custom_reward_function_end_to_end_on_two_ranks(custom_reward_run):
    """reward.fn names a module of the user's (on PYTHONPATH): the logged rewards are exactly what it
    gives.  The same run switches on TIS and overlong filtering and checks what they log, and takes
    two optimizer steps per rollout: the old log-probs come from the pipeline before the first, so in
    the second epoch the ratio moves away from 1 wherever the first had a gradient."""
    out, _, _, res = custom_reward_run
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "rlft.train_grpo: 2 rank(s)" in res.stderr
    steps = read_steps(out)
    # Step 2 ran under the profiler: each rank's table names its phases and what ran in them.
    assert [s.get("profiled") for s in steps] == [None, 1]
    assert sorted(p.name for p in (out / "profile").iterdir()) == ["step2_rank0.txt", "step2_rank1.txt"]
    policy_table = (out / "profile" / "step2_rank0.txt").read_text()
    assert policy_table.startswith("step 2, rank 0 (policy[stage 0/1, replica 0]), sorted by self_cpu_time_total")
    assert "phase:train" in policy_table and "aten::mm" in policy_table
    assert "phase:sample" in (out / "profile" / "step2_rank1.txt").read_text()
    samples = logged_samples(out)
    assert [s["step"] for s in steps] == [1, 2] and sorted(samples) == [1, 2]
    possible_means = {(k * 1.0 + (4 - k) * 0.25) / 4 for k in range(5)}
    for s in steps:
        rows = samples[s["step"]]
        assert len(rows) == 4  # every response of the step (rollout_batch_size 4)
        for reward, response in rows:
            assert reward == (1.0 if "7" in response else 0.25), (reward, response)
        assert s["reward/mean"] == pytest.approx(sum(r for r, _ in rows) / 4, abs=1e-12)
        assert s["reward/mean"] in possible_means and s["reward/answer"] == s["reward/mean"]
        assert {s["batch/reward_min"], s["batch/reward_max"]} <= {0.25, 1.0}
        # The HF sampler and the pipeline run the same fp32 weights on CPU: the sampler's log-probs
        # agree with the trainer's to float noise, token by token (so they are aligned right).
        assert abs(s["rollout_mismatch/kl"]) < 1e-6
        assert abs(s["rollout_mismatch/ratio_max"] - 1) < 1e-3 and abs(s["rollout_mismatch/ratio_min"] - 1) < 1e-3
        assert s["rollout_mismatch/capped_fraction"] == 0
        assert s["overlong/filtered"] == pytest.approx(4 * s["response_length/clipped_fraction"])
    moved = [s for s in steps if s["batch/zero_variance_group_fraction"] < 1]
    assert moved, steps
    assert all(s["ratio_max"] > 1.0 for s in moved)


def test_finished_output_is_evaluated_not_retrained(custom_reward_run):
    # The same launch again on the finished run's output: its model is evaluated, nothing retrained.
    out, args, env, first = custom_reward_run
    assert first.returncode == 0, first.stderr[-4000:]
    res = launch(*args, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "already holds a trained model" in res.stderr
    assert len(read_steps(out)) == 2
    summary = json.loads((out / "eval" / "final" / "summary.json").read_text())
    assert summary["num_examples"] == 4


def test_a_bad_reward_function_is_refused_before_launch(tiny_run, tmp_path):
    out = tmp_path / "never"
    res = launch(*tiny_run["common"][:2], f"output.dir={out}", *tiny_run["common"][3:], *TWO_RANKS,
                 "reward.fn=no_such_reward_module:reward", timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("rlft: config error: reward.fn: "), lines
    assert "no_such_reward_module" in lines[0]
    assert not out.exists()


# ---------------------------------------------------------------- nothing lost, nothing silent

LONG_QUESTION = "How many apples are there? " + "an apple and " * 40_000  # ~280k tokens: far past 2048 positions


def weights_checksum(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    from rlft.engines.base import named_weights_checksum

    tensors = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return named_weights_checksum(tensors.items())


@pytest.fixture(scope="module")
def failed_eval_run(tiny_run):
    """3 steps whose weights are synced every 2 (so not after the last), with only the final
    evaluation, whose output path is taken by a file: the evaluation fails after training.  Both
    splits hold an over-long question, which drawn would ask the sampler for a 280k-token prompt."""
    root = tiny_run["root"]
    data = root / "gsm8k_long"
    data.mkdir()
    for split, at in (("train", 3), ("test", 1)):
        rows = (tiny_run["data"] / f"{split}.jsonl").read_text().splitlines()
        rows.insert(at, json.dumps({"question": LONG_QUESTION, "answer": "It is 5.\n#### 5"}))
        (data / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    out = root / "failed_eval"
    out.mkdir()
    (out / "eval").write_text("a file where the evaluation writes its directory\n")
    args = (f"model.path={tiny_run['model']}", f"data.source={data}", f"output.dir={out}",
            "sampling.repetition_penalty=1.0", "data.prompt_template=r1_short", "data.train_size=9",
            "data.eval_size=5", "schedule.steps=3", "schedule.sync_every=2", "schedule.evaluate_freq=0",
            "schedule.save_every=2", *TWO_RANKS)
    res = launch(*args)
    return {"out": out, "res": res, "args": args, "steps": read_steps(out) if (out / "steps.jsonl").exists() else []}


def test_a_failing_final_evaluation_keeps_the_trained_model(failed_eval_run):
    out, res = failed_eval_run["out"], failed_eval_run["res"]
    # Exit status 1 says something failed; the one line says what, and that the model is kept.
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-6000:]
    failed = [line for line in res.stderr.splitlines() if line.startswith("rlft: evaluation at step 3 failed: ")]
    assert len(failed) == 1 and "Not a directory" in failed[0], res.stderr[-4000:]
    assert not [line for line in res.stderr.splitlines() if line.startswith("rlft: rank")]  # no rank failed
    # The checkpoint and model/ were written before the evaluation.
    ck = out / "checkpoints" / "step_000003"
    assert (ck / "trainer_state.json").is_file()
    assert json.loads((out / "model" / "rlft_state.json").read_text()) == {"step": 3}
    assert weights_checksum(out / "model") == weights_checksum(ck / "hf")
    steps = failed_eval_run["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3] and steps[2]["eval/failed"] == 1


def test_the_final_evaluation_scores_the_final_weights(failed_eval_run):
    # sync_every=2: step 3 trained after the last sync; the final evaluation synced its weights first.
    last = failed_eval_run["steps"][-1]
    final = weights_checksum(failed_eval_run["out"] / "model")
    assert last["sync/engine_sum"] == pytest.approx(final["sum"], rel=1e-9)
    assert last["sync/engine_abs_sum"] == pytest.approx(final["abs_sum"], rel=1e-9)


def test_over_long_prompts_are_skipped_and_counted_at_load_time(failed_eval_run):
    res, steps = failed_eval_run["res"], failed_eval_run["steps"]
    for split in ("train", "test"):
        assert f"gsm8k_long [{split}]: skipped 1 rows whose prompt is longer than" in res.stderr
    assert "sampler: 8 training prompts" in res.stderr
    drawn = {i for s in steps for i in s["prompt_indices"]}
    assert drawn and 3 not in drawn  # the long row's index in the train file


def test_a_run_stopped_before_writing_model_exports_on_relaunch(failed_eval_run):
    # As if the launch had been killed after publishing the last checkpoint, before model/.
    out = failed_eval_run["out"]
    shutil.rmtree(out / "model")
    (out / "eval").unlink()
    res = launch(*failed_eval_run["args"])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "the checkpoint of step 3 is the run's last: exporting it" in res.stderr
    assert weights_checksum(out / "model") == weights_checksum(out / "checkpoints" / "step_000003" / "hf")
    # No step ran again; the final evaluation completed step 3's record.
    steps = read_steps(out)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[2]["loss"] == failed_eval_run["steps"][2]["loss"] and "eval/accuracy" in steps[2]
    assert json.loads((out / "eval" / "step_000003" / "summary.json").read_text())["num_examples"] == 4


def test_divergence_is_rolled_back_and_stops_the_run_at_a_checkpoint_from_before(taught, tmp_path):
    # Two ranks (the policy; sampler, reference and evaluator) keep the launch short. At lr 1e30 a
    # finite gradient blows the weights up (~1e29): every such update is rolled back, so no
    # checkpoint and no model/ ever hold diverged weights.
    model, data = taught
    out = tmp_path / "diverged"
    res = launch(f"model.path={model}", f"data.source={data}", f"output.dir={out}",
                 "sampling.repetition_penalty=1.0", "data.prompt_template=r1_short",
                 "optim.lr=1e30", "optim.max_nonfinite_steps=2", "schedule.steps=6",
                 "schedule.save_every=1", "schedule.evaluate_freq=0", "topology.policy_ranks=[0]",
                 "topology.pipeline_stages=1", "topology.sampler_rank=1", "topology.reference_rank=1",
                 "topology.evaluator_rank=1")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-6000:]

    def refuse(token):
        raise ValueError(f"steps.jsonl is not standard JSON: {token}")
    steps = [json.loads(line, parse_constant=refuse) for line in (out / "steps.jsonl").read_text().splitlines()]
    # Steps whose groups all tie have no gradient and change nothing; the others are rolled back.
    # Two of those with no sound update between them stop the run.
    bad = [s["step"] for s in steps if s["nonfinite"]]
    stop = steps[-1]["step"]
    assert len(bad) == 2 and bad[-1] == stop < 6, steps
    assert all(s["grad_norm"] == 0 for s in steps if bad[0] < s["step"] < stop), steps
    # The gradients stay finite: the weights never took the update.
    assert all(s["grad_norm"] > 0 and s["rolled_back_updates"] == 1 for s in steps if s["nonfinite"]), steps
    (line,) = [x for x in res.stderr.splitlines() if x.startswith("rlft: training diverged: ")]
    assert f"stopped at step {stop}, after 2 steps from step {bad[0]} on" in line
    assert f"the newest checkpoint from before them is {out}/checkpoints/step_{bad[0] - 1:06d};" in line
    assert "the policy's update was rolled back: the " in res.stderr
    # No checkpoint of a rolled-back step, no model/; every checkpoint holds the starting weights
    # (each update with a gradient was rolled back, those without one change nothing).
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert f"step_{bad[0] - 1:06d}" in kept and f"step_{bad[0]:06d}" not in kept and f"step_{stop:06d}" not in kept
    assert not (out / "model").exists()
    start = weights_checksum(Path(model))
    for name in kept:
        assert weights_checksum(out / "checkpoints" / name / "hf") == start, name


def test_resume_with_another_topology_is_explained_and_can_take_the_weights_only(tiny_run, tmp_path):
    import shutil

    # The 2-stage run's newest checkpoint (step 4), resumed by one process holding a 1-stage policy.
    out = tmp_path / "out"
    shutil.copytree(tiny_run["out"] / "checkpoints" / "step_000004", out / "checkpoints" / "step_000004")
    alone = ("topology.policy_ranks=[0]", "topology.pipeline_stages=1", "topology.sampler_rank=0",
             "topology.reference_rank=0", "topology.evaluator_rank=0")
    common = (*tiny_run["common"][:2], f"output.dir={out}", *tiny_run["common"][3:], *alone, "schedule.steps=5")
    refused = launch(*common)
    assert refused.returncode == 2, refused.stderr[-4000:]
    assert "was written by a policy of 2 pipeline stages x 1 replica, this launch has 1 pipeline stage" \
        in refused.stderr and "output.resume_weights_only=true" in refused.stderr
    assert "ZeRO" not in refused.stderr and "Traceback" not in refused.stderr

    res = launch(*common, "output.resume_weights_only=true")
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resuming the weights only (a fresh optimizer)" in res.stderr
    step = read_steps(out)[-1]
    assert step["step"] == 5
    # The data position survived; the policy started from the checkpoint, not the reference model.
    from rlft.data import PromptSampler

    expected = PromptSampler(8, 2, seed=0)
    assert step["prompt_indices"] == [expected.next_batch() for _ in range(5)][-1]
    assert step["kl"] > 0
