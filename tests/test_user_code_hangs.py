"""A user's code that never returns, in a real launch: `launch/train.sh` -> the `deepspeed` launcher -> 2 ranks
on gloo (the policy on rank 0; the sampler, reference and evaluator on rank 1: the rank whose user code hangs
and one that waits on it, as many as the behaviour needs).  An environment's step() or a reward.fn that hangs
on the model's responses must end the launch within its bound, with one line naming the culprit, the
question and the rank, and leave no rank behind."""
from __future__ import annotations

import os
import re
import subprocess
import textwrap
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "launch" / "configs" / "grpo_cpu_tiny.yaml"
# The policy on rank 0; the sampler (whose environment and reward.fn run the user's code), the reference
# and the evaluator on rank 1.
TWO_RANKS = ("topology.policy_ranks=[0]", "topology.pipeline_stages=1", "topology.sampler_rank=1",
             "topology.reference_rank=1", "topology.evaluator_rank=1")
SAMPLER = "rank 1 \\(sampler \\+ reference \\+ evaluator\\)"
QUESTIONS = [f"What is {a} plus {b}?" for a, b in zip(range(1, 9), range(3, 11))]

USER_CODE = '''
import threading
from rlft.envs.base import Environment, EpisodeStart

class NeverReturns(Environment):
    """One turn, its text prompt the run's; step() never returns (no state: the guard must still name the question)."""
    multi_turn = False

    def open(self, question, ground_truth):
        return EpisodeStart(text=self.prompt.render(question))

    def step(self, state, text):
        threading.Event().wait()


def hangs_on_malformed(response, ground_truth):
    """Grades well-formed answers (the start-up probe's); never returns on any other response."""
    if "</answer>" not in response:
        threading.Event().wait()
    return float("<answer>" + ground_truth + "</answer>" in response.replace(" ", ""))
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from conftest import write_gsm8k_dir
    from tiny_models import tiny_model_dir

    root = tmp_path_factory.mktemp("hangs")
    model = tiny_model_dir(root / "model", family="llama", num_layers=2)
    data = write_gsm8k_dir(root / "gsm8k", {"train": [(q, "5") for q in QUESTIONS],
                                             "test": [(q, "5") for q in QUESTIONS[:4]]})
    (root / "code").mkdir()
    (root / "code" / "rlft_test_hanging_code.py").write_text(textwrap.dedent(USER_CODE))
    return {"root": root, "code": root / "code",
            "common": (f"model.path={model}", f"data.source={data}", "schedule.evaluate_freq=0",
                       "schedule.save_every=0", "schedule.steps=2", "data.shuffle=false", *TWO_RANKS)}


def alive(processes: dict[int, psutil.Process]) -> list[str]:
    """The command lines of those of ``processes`` still running (a zombie waits only for its parent)."""
    left = []
    for p in processes.values():
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(p.cmdline())[:200])
        except psutil.Error:
            pass
    return left


def launch_until_it_fails(setup, name: str, *overrides: str) -> tuple[int, str, float, float]:
    """`launch/train.sh` on the tiny config; (exit status, stderr, seconds in all, seconds from the first
    rank's 'failed' line to the launch's end)."""
    out = setup["root"] / name
    env = dict(os.environ, RLFT_PROGRESS="0",
               PYTHONPATH=os.pathsep.join([str(setup["code"]), os.environ.get("PYTHONPATH", "")]))
    err_path = setup["root"] / f"{name}.err"
    t0 = time.monotonic()
    with open(err_path, "w") as err:
        proc = subprocess.Popen(["bash", str(REPO / "launch" / "train.sh"), str(CONFIG), *setup["common"],
                                 f"output.dir={out}", *overrides], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=err, start_new_session=True)
    failed_at, seen = None, {}
    try:
        while proc.poll() is None:
            try:  # every process of the launch (the ranks, the grader's workers, ...), remembered once seen
                seen.update((p.pid, p) for p in psutil.Process(proc.pid).children(recursive=True))
            except psutil.Error:
                pass
            if failed_at is None and re.search(r"rlft: rank \d \(.*\) failed", err_path.read_text(errors="replace")):
                failed_at = time.monotonic()
            assert time.monotonic() - t0 < 400, err_path.read_text(errors="replace")[-4000:]
            time.sleep(0.2)
        end = time.monotonic()
        stderr = err_path.read_text(errors="replace")
        assert len(seen) >= 5 and not alive(seen), alive(seen)  # the ranks and more were seen; none is left
        return proc.returncode, stderr, end - t0, end - (failed_at or end)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()


def test_an_environment_step_that_never_returns_ends_the_launch(setup):
    env_name = "rlft_test_hanging_code:NeverReturns"
    rc, stderr, took, after = launch_until_it_fails(setup, "env_step", f"environment.name={env_name}",
                                                    "environment.step_timeout_s=3")
    print(f"\nenvironment step() hang: exit {rc} after {took:.1f} s, {after:.1f} s after the failure line")
    assert rc != 0, stderr[-4000:]
    lines = [line for line in stderr.splitlines() if f"environment '{env_name}' step()" in line]
    assert len(lines) == 1, stderr[-4000:]
    assert re.search(rf"rlft: {SAMPLER} failed: EnvironmentCallError: environment "
                     rf"'{env_name}' step\(\) \(question 'What is \d plus \d+\?', rank 1\) did not return within 3 s",
                     lines[0]), lines[0]
    assert after < 30, stderr[-4000:]  # every other rank stopped on its own (the launch script's last resort is 60 s)


def test_a_reward_fn_that_never_returns_ends_the_launch(setup):
    fn = "rlft_test_hanging_code:hangs_on_malformed"
    rc, stderr, took, after = launch_until_it_fails(setup, "reward_fn", f"reward.fn={fn}", "reward.timeout_s=1")
    print(f"\nreward.fn hang: exit {rc} after {took:.1f} s, {after:.1f} s after the failure line")
    assert rc != 0, stderr[-4000:]
    lines = [line for line in stderr.splitlines() if f"reward.fn {fn}: every call" in line]
    assert len(lines) == 1, stderr[-4000:]
    assert re.search(rf"rlft: {SAMPLER} failed: RewardFunctionError: reward.fn {fn}: every call of a batch of "
                     r"4 failed \(errors=0, timed_out=4, crashed=0; .* e.g. on the question 'What is \d plus \d+\?' "
                     r"\(ground truth '5', rank 1\)", lines[0]), lines[0]
    assert after < 30, stderr[-4000:]
