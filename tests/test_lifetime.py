"""A launch's life and its ends, through the real `deepspeed` launcher on gloo (CPU): stopping the
launcher stops every rank; one launch per output directory; a rank that stops answering is named
by the others, which exit (and one that was killed is named: checked on a stand-in peer).

Layout (3 ranks): rank 0 the policy (one stage), rank 1 the reference + evaluator, rank 2 the sampler.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from rlft.config.outdir_lock import OutputDirInUse, OutputDirLock

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "launch" / "configs" / "grpo_cpu_tiny.yaml"
LAYOUT = ("topology.policy_ranks=[0]", "topology.pipeline_stages=1", "topology.reference_rank=1",
          "topology.evaluator_rank=1", "topology.sampler_rank=2")
ALONE = ("topology.policy_ranks=[0]", "topology.pipeline_stages=1", "topology.reference_rank=0",
         "topology.evaluator_rank=0", "topology.sampler_rank=0")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from conftest import write_gsm8k_dir
    from tiny_models import tiny_model_dir

    root = tmp_path_factory.mktemp("lifetime")
    model = tiny_model_dir(root / "model", family="llama", num_layers=2)
    questions = [f"What is {a} plus {b}?" for a, b in zip(range(1, 9), range(3, 11))]
    data = write_gsm8k_dir(root / "gsm8k", {"train": [(q, "5") for q in questions],
                                             "test": [(q, "5") for q in questions[:4]]})
    return {"root": root, "common": (f"model.path={model}", f"data.source={data}", "schedule.evaluate_freq=0")}


class Launch:
    """`launch/train.sh` in the background (its own session), its output in files."""

    def __init__(self, root: Path, name: str, *overrides: str):
        self.err_path = root / f"{name}.err"
        env = dict(os.environ, RLFT_PROGRESS="0")
        with open(root / f"{name}.out", "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(["bash", str(REPO / "launch" / "train.sh"), str(CONFIG), *overrides],
                                         cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)
        self.seen: dict[int, psutil.Process] = {}

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def ranks(self) -> dict[int, psutil.Process]:
        """Rank -> process, for every rank the launcher has started (remembered once seen)."""
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                m = re.search(r"--local_rank=(\d+)", " ".join(p.cmdline()))
                if m and "rlft.train_grpo" in " ".join(p.cmdline()):
                    self.seen.setdefault(int(m.group(1)), p)
        except psutil.Error:
            pass
        return self.seen

    def stopped_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if re.match(r"rlft: rank \d+ \(.*\) (stopping|failed)", line)]

    def cleanup(self) -> None:
        for p in self.seen.values():
            try:
                p.kill()
            except psutil.Error:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def wait_for(predicate, timeout: float, what: str, launch: Launch | None = None) -> float:
    t0 = time.time()
    while not predicate():
        if time.time() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s: {what}\n" + (launch.stderr[-5000:] if launch else ""))
        time.sleep(0.5)
    return time.time() - t0


def steps_done(out: Path) -> int:
    f = out / "steps.jsonl"
    return len(f.read_text().splitlines()) if f.is_file() else 0


def gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_stopping_the_launcher_stops_every_rank_and_a_second_launch_is_refused(setup):
    out = setup["root"] / "run_term"
    first = Launch(setup["root"], "term", *setup["common"], *LAYOUT, f"output.dir={out}", "schedule.steps=500",
                   "schedule.save_every=1")
    try:
        wait_for(lambda: steps_done(out) >= 2 or first.proc.poll() is not None, 600, "two steps", first)
        assert first.proc.poll() is None, first.stderr[-5000:]
        ranks = first.ranks()
        assert sorted(ranks) == [0, 1, 2]
        launcher = psutil.Process(ranks[0].ppid())  # DeepSpeed's per-node launcher
        # One node: the launch script (train.sh execs launch/_launch.sh) starts DeepSpeed's per-node launcher
        # itself, in a process group of its own; the launch script is the launching command the lock names.
        script = launcher.parent()
        assert script.pid == first.proc.pid and "launch/_launch.sh" in " ".join(script.cmdline()), script.cmdline()

        # A second launch on the same output directory names the running one and exits with status 2.
        second = subprocess.run(["bash", str(REPO / "launch" / "train.sh"), str(CONFIG), *setup["common"], *ALONE,
                                 f"output.dir={out}", "schedule.steps=1"], cwd=REPO, capture_output=True, text=True,
                                timeout=600, env=dict(os.environ, RLFT_PROGRESS="0"))
        assert second.returncode == 2, second.stderr[-4000:]
        refusal = [line for line in second.stderr.splitlines() if "is in use by another launch" in line]
        assert len(refusal) == 1 and refusal[0].startswith("rlft: output.dir "), second.stderr[-4000:]
        assert "rlft.train_grpo: 1 rank(s)" not in second.stderr  # refused before any rank started
        assert f"pid {ranks[0].pid} on " in refusal[0] and f"launching command is pid {script.pid}" in refusal[0]
        assert first.proc.poll() is None and steps_done(out) >= 2  # the first launch runs on

        # SIGTERM to the launching command (what `timeout` or `kill` on train.sh does): every rank stops within
        # seconds, DeepSpeed's launcher and the script with them.
        script.send_signal(signal.SIGTERM)
        took = wait_for(lambda: all(gone(p) for p in [*ranks.values(), launcher, script]), 60, "every rank stopped", first)
        print(f"\nevery rank stopped {took:.1f} s after the launcher was sent SIGTERM")
        lines = first.stopped_lines()
        # Each rank names why: its launcher (or the launching command it watches) is gone, or the signal
        # the launcher passed on reached it first.
        for r in ranks:
            assert any(line.startswith(f"rlft: rank {r} ") and ("its launcher is gone" in line or "received SIGTERM" in line)
                       for line in lines), lines
        # Nothing half-written is left: every checkpoint directory is complete.
        names = [p.name for p in (out / "checkpoints").iterdir()]
        complete = [n for n in names if re.fullmatch(r"step_\d{6}", n)
                    and (out / "checkpoints" / n / "trainer_state.json").is_file()]
        assert names and complete == names, names
        # The stopped launch's lock is stale: it is taken over, naming the launch it belonged to.
        lock = OutputDirLock(out)
        previous = lock.acquire()
        lock.release()
        assert previous["pid"] == ranks[0].pid and previous["launcher_pid"] == script.pid
    finally:
        first.cleanup()


def test_a_stopped_rank_is_named_and_the_others_exit(setup):
    out = setup["root"] / "run_stop"
    launch = Launch(setup["root"], "stop", *setup["common"], *LAYOUT, f"output.dir={out}", "schedule.steps=500",
                    "schedule.save_every=0", "topology.collective_timeout_minutes=0.25")
    try:
        wait_for(lambda: steps_done(out) >= 1 or launch.proc.poll() is not None, 600, "one step", launch)
        ranks = launch.ranks()
        assert sorted(ranks) == [0, 1, 2], launch.stderr[-5000:]
        ranks[2].suspend()  # SIGSTOP: alive, holding its sockets, answering nothing
        took = wait_for(lambda: gone(ranks[0]) and gone(ranks[1]), 150, "ranks 0 and 1 exited", launch)
        print(f"\nthe other ranks exited {took:.1f} s after rank 2 was stopped (bound: 15 s)")
        lines = launch.stopped_lines()
        for r in (0, 1):
            mine = [line for line in lines if line.startswith(f"rlft: rank {r} ")]
            assert len(mine) == 1 and "rank 2 (sampler) is not answering" in mine[0], lines
        assert not [line for line in lines if " failed: " in line], lines
    finally:
        launch.cleanup()


@pytest.mark.parametrize("victim", [2, 0])
def test_every_survivor_names_the_killed_rank_without_cpp_frames(setup, victim):
    # kill -9 of one rank: the others then stop one after the other (they lose it, or the launcher
    # stops them), rank 0 taking the bridge's store with it. Every survivor must name the rank
    # killed (not rank 0, which merely went before it could look), cite no line nobody printed, and
    # c10d's C++ stacks for calls to a store that is gone must not bury those lines.
    out = setup["root"] / f"run_kill{victim}"
    launch = Launch(setup["root"], f"kill{victim}", *setup["common"], *LAYOUT, f"output.dir={out}",
                    "schedule.steps=500", "schedule.save_every=0", "topology.collective_timeout_minutes=0.5")
    try:
        wait_for(lambda: steps_done(out) >= 1 or launch.proc.poll() is not None, 600, "one step", launch)
        ranks = launch.ranks()
        assert sorted(ranks) == [0, 1, 2], launch.stderr[-5000:]
        ranks[victim].kill()
        took = wait_for(lambda: launch.proc.poll() is not None, 120, "the launch ended", launch)
        print(f"\nthe launch ended {took:.1f} s after rank {victim} was killed")
        lines = launch.stopped_lines()
        for r in sorted(set(ranks) - {victim}):
            mine = [line for line in lines if line.startswith(f"rlft: rank {r} ")]
            assert len(mine) == 1, lines
            why = mine[0].split(" stopping", 1)[1]
            assert f"rank {victim} (" in why and f"(pid {ranks[victim].pid}) ended" in why, lines
            assert not [o for o in ranks if o not in (r, victim) and f"rank {o} (" in why], lines
            assert "own line" not in why and "'failed' line" not in why, lines  # the killed rank printed none
        assert not [line for line in lines if line.startswith(f"rlft: rank {victim} ")], lines
        frames = [line for line in launch.stderr.splitlines() if re.match(r"frame #\d+|Exception raised from ", line)]
        assert len(frames) <= 3, "\n".join(frames[:40])
    finally:
        launch.cleanup()


def test_the_output_lock_names_its_holder_and_is_taken_over_when_the_holder_is_gone(tmp_path):
    holder = subprocess.Popen(
        ["python", "-c", "import sys, time\nfrom rlft.config.outdir_lock import OutputDirLock\n"
         f"OutputDirLock({str(tmp_path)!r}).acquire(launcher_pid=4242)\nprint('held', flush=True)\ntime.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputDirInUse) as e:
            OutputDirLock(tmp_path).acquire()
        assert f"pid {holder.pid} on " in str(e.value) and "launching command is pid 4242" in str(e.value)
        # The launch's own check, before any rank starts, says the same and takes nothing.
        with pytest.raises(OutputDirInUse) as probed:
            OutputDirLock(tmp_path).check_free()
        assert str(probed.value) == str(e.value)
    finally:
        holder.kill()
        holder.wait()
    stale = (tmp_path / ".lock").read_text()
    OutputDirLock(tmp_path).check_free()  # the holder is gone: free, and the record is left for the rank
    assert (tmp_path / ".lock").read_text() == stale
    OutputDirLock(tmp_path / "new").check_free()
    assert not (tmp_path / "new").exists()
    lock = OutputDirLock(tmp_path)
    previous = lock.acquire()
    assert previous["pid"] == holder.pid  # stale: recognised and taken over
    lock.release()
    assert json.loads((tmp_path / ".lock").read_text() or "{}") == {}  # a finished launch leaves no holder
    assert OutputDirLock(tmp_path).acquire() is None


BLOCKED_RANK = """
import datetime, os, sys
import torch.distributed as dist
from rlft.common import free_port
from rlft.runtime.watchdog import Watchdog

def stop(reason, code):
    print("stopping:", reason, flush=True)
    os._exit(code)

Watchdog(stop)
store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
print("ready", flush=True)
store.wait(["never"], datetime.timedelta(hours=1))  # the main thread blocked in C++, like a collective
print("woke up", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_a_rank_whose_main_thread_waits_in_a_collective(sig):
    # A shell's background job starts with SIGINT ignored, and the watchdog rightly stays deaf to an
    # ignored signal: the rank here gets the default disposition whatever way the suite was started.
    proc = subprocess.Popen(["python", "-c", BLOCKED_RANK], stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 128 + sig
        assert proc.stdout.read().strip() == f"stopping: received {sig.name}"
    finally:
        proc.kill()


def test_a_peer_that_was_killed_or_stopped_is_named():
    # What the survivors say when a collective fails for want of a peer (rank.lost_contact): here a
    # one-rank bridge given a second peer, a real process that is then stopped and killed.
    import socket

    from rlft.common import free_port
    from rlft.runtime.bridge import Bridge
    from rlft.runtime.watchdog import Heartbeats, diagnose

    bridge = Bridge(0, 1, master_addr="127.0.0.1", master_port=free_port(), timeout_s=30)
    peer = subprocess.Popen(["sleep", "600"])
    try:
        bridge.world_size = 2
        bridge.peers.append({"host": socket.gethostname(), "pid": peer.pid,
                             "started": psutil.Process(peer.pid).create_time()})
        beats = Heartbeats(bridge)  # its store connection tells whether the peer left a line
        describe = {0: "rank 0 (policy)", 1: "rank 1 (sampler)"}.get
        assert diagnose(bridge, describe, beats) is None
        peer.send_signal(signal.SIGSTOP)
        wait_for(lambda: psutil.Process(peer.pid).status() == psutil.STATUS_STOPPED, 10, "stopped")
        stopped = f"rank 1 (sampler) is not answering: its process (pid {peer.pid}) is stopped, silent for 0 s"
        assert diagnose(bridge, describe, beats) == stopped
        peer.kill()
        gone = f"rank 1 (sampler) is gone: its process (pid {peer.pid}) ended without a message (killed?)"
        wait_for(lambda: diagnose(bridge, describe, beats) == gone, 10, "seen as gone (a zombie)")
        peer.wait()
        assert diagnose(bridge, describe, beats) == gone
        # A failure some rank recorded comes first, named without repeating its cause.
        bridge.report_failure("rlft: rank 1 (sampler) failed: FileNotFoundError: no 'nosuch' split")
        assert diagnose(bridge, describe, beats) == "rank 1 (sampler) failed (its own line names the cause)"
    finally:
        peer.kill()
        peer.wait()


def test_a_rank_stops_when_its_launch_script_is_killed():
    # launch/_launch.sh names itself in RLFT_LAUNCH_SCRIPT; SIGKILL to it (`timeout -s KILL`,
    # `kill -9`), which no trap sees, must still end the ranks, or they train on orphaned.
    import socket

    from rlft.runtime.watchdog import LAUNCH_SCRIPT_ENV, launch_script

    script = subprocess.Popen(["sleep", "600"])
    env = dict(os.environ, **{LAUNCH_SCRIPT_ENV: f"{socket.gethostname()}:{script.pid}"})
    rank = subprocess.Popen(["python", "-c", BLOCKED_RANK], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert rank.stdout.readline().strip() == "ready"
        time.sleep(1.5)
        assert rank.poll() is None  # the script runs: so does the rank
        script.kill()
        script.wait()
        t0 = time.time()
        assert rank.wait(timeout=30) == 1
        print(f"\nthe rank stopped {time.time() - t0:.1f} s after its launch script was killed")
        assert rank.stdout.read().strip() == (f"stopping: its launcher is gone: the launch script (pid {script.pid}) "
                                              f"ended, so nothing else would stop this rank")
    finally:
        rank.kill()
        script.kill()
    # Another host's launch script (srun passes the environment on) is not this rank's to watch.
    os.environ[LAUNCH_SCRIPT_ENV] = f"not-{socket.gethostname()}:{os.getpid()}"
    try:
        assert launch_script() == []
    finally:
        del os.environ[LAUNCH_SCRIPT_ENV]


BRIDGED_RANK = """
import datetime, os, sys, time
import torch.distributed as dist
from rlft.common import free_port
from rlft.runtime.bridge import Bridge
from rlft.runtime.watchdog import Watchdog

def stop(reason, code):
    print("stopping:", reason, flush=True)
    os._exit(code)

rank, port = int(sys.argv[1]), int(sys.argv[2])
watchdog = Watchdog(stop)
bridge = Bridge(rank, 2, master_addr="127.0.0.1", master_port=port, timeout_s=60, collective_timeout_s=6)
bridge.bound_waits()
watchdog.watch_peers(bridge, lambda r: f"rank {r}")
print("ready", flush=True)
if rank == 0:
    time.sleep(3600)
store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
store.wait(["never"], datetime.timedelta(hours=1))  # the main thread blocked in C++, like a collective
"""


def test_a_stopped_rank_0_is_named_within_the_timeout():
    # Rank 0 hosts the store the heartbeats go through; stopped (SIGSTOP), it keeps its sockets
    # open and answers nothing: a heartbeat's store call then waits in recv() for ever, and the
    # silence check behind it must still run.
    from rlft.common import free_port

    port = free_port()
    ranks = [subprocess.Popen(["python", "-c", BRIDGED_RANK, str(r), str(port)], stdout=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        assert [p.stdout.readline().strip() for p in ranks] == ["ready", "ready"]
        time.sleep(4)  # a few heartbeats while both run
        assert ranks[1].poll() is None
        ranks[0].send_signal(signal.SIGSTOP)
        t0 = time.time()
        assert ranks[1].wait(timeout=60) == 1
        took = time.time() - t0
        print(f"\nrank 1 stopped {took:.1f} s after rank 0 was stopped (bound: 6 s)")
        line = ranks[1].stdout.read().strip()
        assert line.startswith(f"stopping: rank 0 is not answering: its process (pid {ranks[0].pid}) is stopped, "
                               f"silent for "), line
        assert line.endswith("(the bound is topology.collective_timeout_minutes)"), line
        assert 6 <= took < 20
    finally:
        for p in ranks:
            p.kill()
            p.wait()


def test_a_launch_refused_by_its_ranks_leaves_no_lock_to_take_over(setup):
    # 2040 evaluation tokens leave 8 of the model's 2048 positions for a prompt, fewer than any evaluation
    # question takes: the evaluator's rank finds that out as it measures the questions (a config error,
    # exit 2), after the launch took the lock. A clean end like this leaves nothing half-written, so the
    # next launch has no stale lock to take over.
    out = setup["root"] / "run_refused"
    res = subprocess.run(["bash", str(REPO / "launch" / "train.sh"), str(CONFIG), *setup["common"], *ALONE,
                          f"output.dir={out}", "sampling.eval_max_tokens=2040"], cwd=REPO, capture_output=True,
                         text=True, timeout=600, env=dict(os.environ, RLFT_PROGRESS="0"))
    assert res.returncode == 2, res.stderr[-4000:]
    assert "failed: config error: data.eval_split: none of the" in res.stderr, res.stderr[-4000:]
    assert (out / ".lock").is_file()  # the launch held it
    lock = OutputDirLock(out)
    assert lock.acquire() is None  # nothing to take over
    lock.release()


def test_the_last_steps_record_survives_a_failed_final_export(setup):
    # OUT/model is in the way (a file): the final export fails after the last step trained. Its
    # reward and loss were recorded only after the export, so they were lost with it.
    out = setup["root"] / "run_export"
    out.mkdir()
    (out / "model").write_text("in the way")
    res = subprocess.run(["bash", str(REPO / "launch" / "train.sh"), str(CONFIG), *setup["common"], *ALONE,
                          f"output.dir={out}", "schedule.steps=1"], cwd=REPO, capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, RLFT_PROGRESS="0"))
    assert res.returncode == 1, res.stderr[-4000:]
    # The checkpoint was published before the export: the line names the model, not the checkpoint.
    assert f"could not export the final model {out / 'model'}: " in res.stderr, res.stderr[-4000:]
    assert "step_000001 was saved intact" in res.stderr and "could not save checkpoint" not in res.stderr
    assert (out / "checkpoints" / "step_000001" / "trainer_state.json").is_file()
    (record,) = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and isinstance(record["loss"], float) and 0 <= record["reward/mean"] <= 1, record


def test_peers_seen_going_together_name_rank_0_when_it_is_one_of_them():
    # Rank 0 killed; rank 1 loses the store with it and stops a moment later; rank 2's watchdog,
    # held up for longer than a poll, sees both gone in the same check: it names rank 0 alone.
    # Without rank 0 among them, nothing tells the peers apart and all are named.
    from types import SimpleNamespace

    from rlft.runtime.watchdog import PeersSeen, _first_gone

    bridge = SimpleNamespace(rank=2, world_size=4, peers=[{"pid": 100 + r} for r in range(4)])
    describe = {0: "rank 0 (policy)", 1: "rank 1 (reference)", 3: "rank 3 (sampler)"}.get
    seen = PeersSeen()
    seen.gone_at = {0: 5.0, 1: 5.0, 3: 5.0}
    seen.said = {0: None, 1: None, 3: None}
    assert _first_gone(bridge, describe, None, seen, [0, 1, 3]) == (
        "rank 0 (policy) is gone: its process (pid 100) ended, and the store it hosted with it, "
        "so whether it left a message cannot be told (killed?)")
    assert _first_gone(bridge, describe, None, seen, [1, 3]) == (
        "rank 1 (reference) (pid 101) and rank 3 (sampler) (pid 103) are gone: their processes ended "
        "together, and which went first cannot be told")
    seen.said[3] = ""  # rank 3 left no message: killed, where rank 1's is unknown
    assert _first_gone(bridge, describe, None, seen, [0, 1, 3]) == (
        "rank 3 (sampler) is gone: its process (pid 103) ended without a message (killed?)")


_SAYERS = """
import sys
from rlft.common import say_line
me = sys.argv[1]
for i in range(300):
    say_line(f"rlft: rank {me} stopping: " + "x" * 150 + f" {i}")
"""


def test_stop_lines_of_ranks_printing_at_once_stay_whole():
    # Every rank of a launch writes its stop line to the launcher's stderr at about the same
    # moment; a line written in two pieces (the text, then its newline) ran into another rank's.
    import sys

    repo = Path(__file__).resolve().parents[1]
    read, write = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", _SAYERS, str(r)], stderr=write, cwd=repo,
                              env=dict(os.environ, PYTHONPATH=str(repo), PYTHONUNBUFFERED="1")) for r in range(6)]
    os.close(write)
    with os.fdopen(read) as stream:
        lines = stream.read().splitlines()
    assert [p.wait(timeout=60) for p in procs] == [0] * 6
    whole = re.compile(r"rlft: rank \d stopping: x{150} \d+")
    assert len(lines) == 6 * 300 and all(whole.fullmatch(line) for line in lines), \
        [line for line in lines if not whole.fullmatch(line)][:3]
