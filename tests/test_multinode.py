"""Two simulated nodes on one machine, through the real `deepspeed` launcher in its per-node mode.

Each "node" is its own `launch/train.sh` (DeepSpeed's `--no_ssh --node_rank N`), both reading one
hostfile that names two hosts reaching this machine (launch/hostfiles/cpu_2node); the ranks meet at
127.0.0.1 over gloo.  Layout (launch/configs/grpo_cpu_2node.yaml):

    node 0: rank 0 policy stage 0, rank 1 reference
    node 1: rank 2 policy stage 1, rank 3 sampler + evaluator

so the pipeline's activations, the rollout batch, the reference log-probs and the weight sync all
cross between the nodes, and on node 1 global rank, local rank and policy rank all differ.
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

from rlft.common import free_port

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "launch" / "configs" / "grpo_cpu_2node.yaml"
START_TIMEOUT_S = 900  # two launchers, four ranks, on two shared cores
STOP_BOUND_S = 120  # every rank of both nodes gone after one node's launcher is stopped


class TwoNodes:
    """Both nodes' launchers of one run; their output goes to node0.log / node1.log."""

    def __init__(self, root: Path, *overrides: str):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        port = free_port()
        env = dict(os.environ, RLFT_PROGRESS="0")
        self.procs = []
        for node in (0, 1):
            with open(root / f"node{node}.log", "w") as log:
                self.procs.append(subprocess.Popen(
                    ["bash", str(REPO / "launch" / "train.sh"), str(CONFIG), f"topology.node_rank={node}",
                     f"topology.master_port={port}", *overrides],
                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def log(self, node: int) -> str:
        return (self.root / f"node{node}.log").read_text(errors="replace")

    def tail(self) -> str:
        return "\n".join(f"--- node {n} ---\n{self.log(n)[-5000:]}" for n in (0, 1))

    def wait(self, timeout: float) -> list[int]:
        deadline = time.time() + timeout
        try:
            return [p.wait(timeout=max(1.0, deadline - time.time())) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the run did not end within {timeout:.0f} s\n{self.tail()}") from None

    def ranks(self, node: int) -> list[psutil.Process]:
        """The rank processes a node's launcher started (DeepSpeed passes each one --local_rank)."""
        try:
            kids = psutil.Process(self.procs[node].pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        out = []
        for p in kids:
            try:
                if any(a.startswith("--local_rank") for a in p.cmdline()):
                    out.append(p)
            except psutil.Error:
                pass
        return out

    def kill(self) -> None:
        """Clean-up after a failed check: the launchers this test started and everything under them
        (the deepspeed launcher runs in a process group of its own), by process id."""
        for p in self.procs:
            try:
                tree = psutil.Process(p.pid).children(recursive=True) + [psutil.Process(p.pid)]
            except psutil.NoSuchProcess:
                continue
            for proc in tree:
                try:
                    proc.kill()
                except psutil.Error:
                    pass


def wait_for(predicate, timeout: float, nodes: TwoNodes, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if any(p.poll() is not None for p in nodes.procs):
            nodes.kill()
            raise AssertionError(f"a launcher ended while waiting for {what}\n{nodes.tail()}")
        if time.time() > deadline:
            nodes.kill()
            raise AssertionError(f"no {what} within {timeout:.0f} s\n{nodes.tail()}")
        time.sleep(2)


def read_steps(out: Path) -> list[dict]:
    f = out / "steps.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.is_file() else []


@pytest.fixture(scope="module")
def setup(tmp_path_factory, taught_sums_dirs):
    root = tmp_path_factory.mktemp("two_nodes")
    model, data = taught_sums_dirs
    common = (f"model.path={model}", f"data.source={data}", "data.train_size=8", "data.eval_size=2",
              "data.prompt_template=r1_short", "sampling.max_tokens=16", "sampling.repetition_penalty=1.0",
              "grpo.group_size=2", "optim.rollout_batch_size=4", "optim.train_micro_batch_size=2",
              "schedule.evaluate_freq=0", "schedule.save_every=0", "schedule.log_samples_every=0")
    return {"root": root, "common": common}


@pytest.fixture(scope="module")
def finished_run(setup):
    out = setup["root"] / "run"
    t0 = time.time()
    nodes = TwoNodes(setup["root"] / "logs", *setup["common"], f"output.dir={out}", "schedule.steps=3")
    codes = nodes.wait(START_TIMEOUT_S)
    print(f"\nCPU wall time: two nodes, 3 steps: {time.time() - t0:.1f} s")
    assert codes == [0, 0], nodes.tail()
    return {"nodes": nodes, "out": out}


def test_ranks_run_where_the_topology_places_them(finished_run):
    nodes = finished_run["nodes"]
    expected = {0: [(0, "policy[stage 0/2, replica 0]", 0), (1, "reference", 1)],
                1: [(2, "policy[stage 1/2, replica 0]", 0), (3, "sampler + evaluator", 1)]}
    for node, ranks in expected.items():
        log = nodes.log(node)
        assert "[rlft] node 1: policy stage 1 on rank 2; sampler + evaluator on rank 3" in log
        for rank, roles, local in ranks:
            line = re.escape(f"rank {rank} ({roles}) on node {node} of 2 (") + r"[^)]*" + re.escape(
                f"), local rank {local}")
            assert re.search(line, log), (node, rank, log[-3000:])
        other = nodes.log(1 - node)
        assert not any(f"rank {rank} (" in line and " on node " in line
                       for rank, _, _ in ranks for line in other.splitlines())


def test_sampler_weights_equal_the_policy_after_every_sync(finished_run):
    steps = read_steps(finished_run["out"])
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        # policy_sum adds what stage 0 (node 0) and stage 1 (node 1) sent; engine_sum is what the
        # sampler's engine on node 1 holds after loading both.
        assert s["sync/engine_sum"] == pytest.approx(s["sync/policy_sum"], rel=1e-9, abs=1e-9)
        assert s["sync/engine_abs_sum"] == pytest.approx(s["sync/policy_abs_sum"], rel=1e-9)
    # The policy moved (some step had a gradient), so the checksums compare fresh weights.
    assert len({s["sync/policy_abs_sum"] for s in steps}) > 1
    assert (finished_run["out"] / "model" / "config.json").is_file()


@pytest.mark.parametrize("stopped", [1, 0])
def test_stopping_one_nodes_launcher_stops_the_whole_run(setup, tmp_path, stopped):
    out = tmp_path / "run"
    nodes = TwoNodes(tmp_path / "logs", *setup["common"], f"output.dir={out}", "schedule.steps=1000")
    wait_for(lambda: len(read_steps(out)) >= 1, START_TIMEOUT_S, nodes, "first step")
    ranks = {node: nodes.ranks(node) for node in (0, 1)}
    assert [len(ranks[0]), len(ranks[1])] == [2, 2], ranks

    t0 = time.time()
    nodes.procs[stopped].send_signal(signal.SIGTERM)
    codes = nodes.wait(STOP_BOUND_S)
    _, alive = psutil.wait_procs(ranks[0] + ranks[1], timeout=max(1.0, STOP_BOUND_S - (time.time() - t0)))
    took = time.time() - t0
    assert not alive, f"ranks still running {took:.0f} s after the stop: {alive}\n{nodes.tail()}"
    assert all(c != 0 for c in codes), (codes, nodes.tail())
    print(f"\nnode {stopped}'s launcher stopped: every rank gone after {took:.1f} s, exit codes {codes}")

    # Every rank says in one line why it stops: the stopped node's ranks name the signal, or that the
    # launching command they watch has ended (whichever reaches a rank first), the other node's ranks
    # that they lost contact (or the cause the first one recorded).
    for node, on_node in ((0, [0, 1]), (1, [2, 3])):
        lines = [line for line in nodes.log(node).splitlines() if re.match(r"rlft: rank \d+ \(", line)]
        print("\n".join(lines))
        assert sorted(int(line.split()[2]) for line in lines) == on_node, nodes.log(node)[-4000:]
        if node == stopped:
            assert all("received SIGTERM" in line or "its launcher is gone: the launching command" in line
                       for line in lines), lines
            assert any("received SIGTERM" in line for line in lines), lines
    assert len(read_steps(out)) < 1000
