"""The launch plan (rlft.config.launch_plan) for one node and for several through DeepSpeed's launchers, and
the commands DeepSpeed's own runner builds from it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlft.config import ConfigError, load_config
from rlft.config.launch_plan import make_plan, read_hostfile

from test_preflight import EMPTY_SAFETENSORS

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "launch" / "configs"
TWO_BY_EIGHT = CONFIGS / "grpo_2x8gpu.yaml"


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the configs name their hostfiles relative to the checkout


def plan_of(config: Path | None, *overrides: str, gpus: int = 8):
    return make_plan(load_config(config, list(overrides)), gpus)


def local_model(tmp_path: Path) -> Path:
    """A directory the launch's checks take for a model (config, weights file), made once beside
    `tmp_path` (whose contents some tests list)."""
    path = tmp_path.parent / f"{tmp_path.name}_model"
    if not path.is_dir():
        path.mkdir()
        (path / "config.json").write_text('{"num_hidden_layers": 4}')
        (path / "model.safetensors").write_bytes(EMPTY_SAFETENSORS)
        (path / "tokenizer.json").write_text("{}")
    return path


def write_hostfile(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "hostfile"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


# ---------------------------------------------------------------- one node


def test_one_node_starts_deepspeeds_per_node_launcher_as_its_runner_would(monkeypatch):
    import base64

    from deepspeed.launcher import launch, runner

    plan = plan_of(CONFIGS / "grpo_8gpu.yaml")
    assert (plan.world, plan.nodes, plan.per_node, plan.entry, plan.rank_args, plan.launcher) == (
        8, 1, 8, "module", [], "node")
    assert plan.placement == ["node 0: policy stages 0-4 on ranks 0-4; evaluator on rank 5; reference on rank 6; "
                              "sampler on rank 7"]
    port = int(plan.ds_args[2].removeprefix("--master_port="))
    assert port > 0
    # What `deepspeed --num_gpus 8 --master_port P` hands the per-node launcher on one host.
    ranks = runner.apply_num_nodes_and_gpus({"localhost": 8}, -1, 8)
    assert plan.ds_args == [f"--world_info={runner.encode_world_info(ranks)}", "--master_addr=127.0.0.1",
                            f"--master_port={port}"]
    monkeypatch.setattr(sys, "argv", ["launch", *plan.ds_args, "--module", "rlft.train_grpo", "--config", "x.yaml"])
    args = launch.parse_args()
    assert json.loads(base64.urlsafe_b64decode(args.world_info)) == {"localhost": list(range(8))}
    assert (args.master_addr, args.master_port, args.module, args.training_script, args.training_script_args) == (
        "127.0.0.1", port, True, "rlft.train_grpo", ["--config", "x.yaml"])
    assert plan_of(CONFIGS / "grpo_8gpu.yaml", "topology.master_port=29999").ds_args[2] == "--master_port=29999"
    assert "launcher=node" in plan.shell().splitlines()[0]


def test_free_ports_are_drawn_outside_the_ephemeral_range(monkeypatch):
    """A launch's port comes from below the kernel's ephemeral ports, which any outgoing connection
    may take before the launch listens; two draws differ; a taken port is passed over."""
    import socket

    import rlft.common as common

    lo, hi = common.ephemeral_ports()
    assert lo <= hi
    ports = [common.free_port() for _ in range(20)]
    assert all(common.PORT_RANGE[0] <= p <= common.PORT_RANGE[1] and not lo <= p <= hi for p in ports)
    assert len(set(ports)) > 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # free when drawn: it can be bound
    # The only candidate taken: the kernel's pick instead.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        monkeypatch.setattr(common, "PORT_RANGE", (taken, taken))
        monkeypatch.setattr(common, "ephemeral_ports", lambda: (1, 1))
        assert common.free_port() != taken


# ---------------------------------------------------------------- the 2 x 8 GPU layout


def test_two_by_eight_layout_places_the_pipeline_over_both_nodes():
    cfg = load_config(TWO_BY_EIGHT)
    t = cfg.topology
    assert (cfg.world_size(), t.nodes, t.pipeline_stages, len(t.policy_ranks)) == (16, 2, 7, 14)
    plan = make_plan(cfg, 8)
    assert plan.placement == [
        "node 0: policy stages 0-3 on ranks 0-7",
        "node 1: policy stages 4-6 on ranks 8-13; reference + evaluator on rank 14; sampler on rank 15"]
    # Every stage's two replicas share a node: gradient all-reduces stay inside a node.
    from rlft.config.topology import policy_rank_of

    for stage in range(7):
        ranks = [policy_rank_of(t, replica, stage) for replica in range(2)]
        assert len({r // 8 for r in ranks}) == 1, (stage, ranks)
    # Qwen2.5-Math-7B's 28 layers split evenly over the 7 stages.
    from rlft.config.topology import check_stages_vs_layers

    check_stages_vs_layers(28, 7)


def test_two_by_eight_needs_eight_gpus_per_node():
    with pytest.raises(ConfigError, match="topology needs 8 GPUs per node but 4 are available here"):
        plan_of(TWO_BY_EIGHT, gpus=4)


def test_pdsh_plan():
    plan = plan_of(TWO_BY_EIGHT)
    assert plan.ds_args == ["--hostfile", "launch/hostfiles/2x8gpu", "--master_port", "29500",
                            "--num_nodes", "2", "--num_gpus", "8"]
    assert (plan.world, plan.nodes, plan.per_node, plan.entry, plan.rank_args) == (16, 2, 8, "module", [])
    assert plan.launcher == "runner"  # several nodes: the `deepspeed` command, which starts each node's launcher
    addr = plan_of(TWO_BY_EIGHT, "topology.master_addr=10.0.0.1").ds_args
    assert addr[-2:] == ["--master_addr", "10.0.0.1"]


def test_slurm_plan():
    plan = plan_of(TWO_BY_EIGHT, "topology.launcher=slurm", "topology.launcher_args=--partition=gpu")
    assert plan.ds_args == ["--hostfile", "launch/hostfiles/2x8gpu", "--master_port", "29500",
                            "--num_nodes", "2", "--num_gpus", "8", "--launcher", "slurm", "--no_ssh_check",
                            "--master_addr", "node-0", "--launcher_args=--ntasks-per-node=8 --partition=gpu"]
    assert plan.entry == "script"
    assert plan.rank_args == ["topology.master_addr=node-0", "topology.master_port=29500"]


def test_mpi_plans_take_the_hostfile_as_it_is():
    for launcher in ("openmpi", "mpich", "impi", "mvapich"):
        plan = plan_of(TWO_BY_EIGHT, f"topology.launcher={launcher}", "topology.master_addr=10.0.0.1")
        assert plan.ds_args == ["--hostfile", "launch/hostfiles/2x8gpu", "--master_port", "29500",
                                "--launcher", launcher, "--no_ssh_check", "--master_addr", "10.0.0.1"]
        assert plan.entry == "module"
        assert plan.rank_args == ["topology.master_addr=10.0.0.1", "topology.master_port=29500"]


def test_no_ssh_plan_is_one_node_of_the_launch():
    for node in (0, 1):
        plan = plan_of(TWO_BY_EIGHT, "topology.launcher=no_ssh", "topology.master_addr=10.0.0.1",
                       f"topology.node_rank={node}")
        assert plan.ds_args == ["--hostfile", "launch/hostfiles/2x8gpu", "--master_port", "29500",
                                "--num_nodes", "2", "--num_gpus", "8", "--no_ssh", "--node_rank", str(node),
                                "--master_addr", "10.0.0.1"]


def test_cpu_two_node_config_plan():
    plan = plan_of(CONFIGS / "grpo_cpu_2node.yaml", "topology.node_rank=1", gpus=-1)
    assert plan.ds_args == ["--hostfile", "launch/hostfiles/cpu_2node", "--master_port", "29500",
                            "--num_nodes", "2", "--num_gpus", "2", "--no_ssh", "--node_rank", "1",
                            "--master_addr", "127.0.0.1"]
    assert plan.placement == ["node 0: policy stage 0 on rank 0; reference on rank 1",
                              "node 1: policy stage 1 on rank 2; sampler + evaluator on rank 3"]
    assert read_hostfile("launch/hostfiles/cpu_2node") == [("localhost", 2), ("127.0.0.1", 2)]


# ---------------------------------------------------------------- what DeepSpeed builds from a plan


def deepspeed_runner(plan, tail: list[str]):
    """DeepSpeed's runner as its main() sets it up for `deepspeed <plan> <tail>`: (args, pool, active)."""
    from deepspeed.launcher import runner

    args = runner.parse_args(plan.ds_args + tail)
    pool = runner.fetch_hostfile(args.hostfile)
    active = runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
    active = runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    return args, pool, active, runner.encode_world_info(active)


def test_deepspeed_builds_an_srun_command_from_the_slurm_plan(tmp_path):
    from deepspeed.launcher.multinode_runner import SlurmRunner

    hostfile = write_hostfile(tmp_path, "gpu-a slots=8", "gpu-b slots=8")
    plan = plan_of(TWO_BY_EIGHT, "topology.launcher=slurm", f"output.hostfile={hostfile}")
    script = str(REPO / "launch" / "rank.py")
    args, pool, active, world = deepspeed_runner(plan, [script, "rlft.train_grpo", "--config", "x.yaml"])
    assert args.no_ssh_check and args.master_addr == "gpu-a" and args.launcher == "slurm"
    cmd = SlurmRunner(args, world, pool).get_cmd(dict(os.environ), active)
    assert cmd[:cmd.index("--export=ALL")] == ["srun", "-n", "16", "--ntasks-per-node=8", "--nodes", "2",
                                                 "--gpus-per-node", "8"]
    assert cmd[cmd.index("--export=ALL") + 2:] == ["-u", script, "rlft.train_grpo", "--config", "x.yaml"]


def test_deepspeed_builds_an_mpirun_command_from_the_openmpi_plan():
    from deepspeed.launcher.multinode_runner import OpenMPIRunner

    plan = plan_of(TWO_BY_EIGHT, "topology.launcher=openmpi")
    args, pool, active, world = deepspeed_runner(plan, ["--module", "rlft.train_grpo", "--config", "x.yaml"])
    cmd = OpenMPIRunner(args, world, pool).get_cmd(dict(os.environ), active)  # refuses --num_nodes/--num_gpus
    assert cmd[:5] == ["mpirun", "-n", "16", "-hostfile", "launch/hostfiles/2x8gpu"]
    assert cmd[cmd.index("-u") + 1:] == ["-m", "rlft.train_grpo", "--config", "x.yaml"]


def test_deepspeed_per_node_launch_gives_node_one_the_upper_ranks():
    """What DeepSpeed's per-node launcher (launch.py) computes for node 1 of the 2 x 8 layout."""
    plan = plan_of(TWO_BY_EIGHT, "topology.launcher=no_ssh", "topology.master_addr=10.0.0.1",
                   "topology.node_rank=1")
    args, _, active, _ = deepspeed_runner(plan, ["--module", "rlft.train_grpo"])
    assert args.no_ssh and args.node_rank == 1 and args.master_addr == "10.0.0.1"
    hosts = list(active)
    assert hosts == ["node-0", "node-1"] and active["node-1"] == list(range(8))
    # launch.py: global ranks follow the host order, local rank = global rank % ranks on the node.
    first = sum(len(active[h]) for h in hosts[:args.node_rank])
    ranks = [first + i for i in range(len(active[hosts[args.node_rank]]))]
    assert ranks == list(range(8, 16)) and [r % 8 for r in ranks] == list(range(8))


def test_rank_entry_script_runs_a_module(tmp_path):
    """launch/rank.py (the slurm entry) runs `rlft.X` as `python -m rlft.X` would."""
    env = dict(os.environ, PYTHONPATH="")
    res = subprocess.run([sys.executable, str(REPO / "launch" / "rank.py"), "rlft.config.launch_plan", "--config",
                          str(CONFIGS / "grpo_8gpu.yaml"), "--gpus-available", "8"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("world=8 nodes=1 per_node=8 entry=module")


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("lines, overrides, message", [
    (None, ["output.hostfile=/nonexistent/hosts"],
     "output.hostfile: /nonexistent/hosts does not exist (one line per node: 'HOST slots=RANKS')"),
    (["node-0 slots=8"], [], "output.hostfile: {path} lists 1 host(s) but topology.nodes is 2"),
    (["node-0 slots=8", "node-1 slots=4"], [],
     "output.hostfile: host node-1 has slots=4 but the topology places 8 ranks on every node (16 ranks / 2 nodes)"),
    (["node-0 slots=8", "node-1 slots=8", "node-2 slots=8"], ["topology.launcher=openmpi"],
     "output.hostfile: {path} lists 3 host(s) but topology.nodes is 2 (the openmpi launcher uses every host listed)"),
    (["node-0 slots=16", "node-1 slots=16"], ["topology.launcher=mpich"],
     "output.hostfile: host node-0 has slots=16 but the topology places 8 ranks on every node (16 ranks / 2 nodes); "
     "the mpich launcher starts every slot listed"),
    (["node-0 slots=8", "node-0 slots=8"], [], "output.hostfile: {path} names host node-0 twice (DeepSpeed refuses that)"),
    (["node-0 8"], [], "output.hostfile: {path} line 1: expected 'HOST slots=N', got 'node-0 8'"),
    (["node-0 slots=8", "node-1 slots=8"], ["topology.launcher=no_ssh", "topology.master_addr=n0"],
     "topology.node_rank: required with topology.launcher=no_ssh; start one launch on every node with "
     "topology.node_rank=0 .. 1"),
    (None, ["output.hostfile=null"],
     "output.hostfile: required when topology.nodes > 1 (one line per node: 'HOST slots=RANKS')"),
])
def test_impossible_multinode_launches_are_refused(tmp_path, lines, overrides, message):
    path = write_hostfile(tmp_path, *lines) if lines else ""
    with pytest.raises(ConfigError) as info:
        plan_of(TWO_BY_EIGHT, *([f"output.hostfile={path}"] if path else []), *overrides)
    assert str(info.value) == message.format(path=path)


def test_a_larger_hostfile_is_trimmed_by_deepspeed(tmp_path):
    path = write_hostfile(tmp_path, "a slots=16", "b slots=16", "c slots=16")
    plan = plan_of(TWO_BY_EIGHT, f"output.hostfile={path}")
    _, _, active, _ = deepspeed_runner(plan, ["--module", "rlft.train_grpo"])
    assert active == {"a": list(range(8)), "b": list(range(8))}


def test_launch_plan_command_line_prints_shell_assignments(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-m", "rlft.config.launch_plan", "--config", str(TWO_BY_EIGHT),
                          "--gpus-available", "8", "topology.launcher=slurm"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    shown = subprocess.run(["bash", "-c", res.stdout + '\nprintf "%s|" "$world" "$entry" "${ds_args[@]}"; echo;'
                            'printf "%s\\n" "$placement"'], capture_output=True, text=True)
    first, *placement = shown.stdout.splitlines()
    assert first.startswith("16|script|--hostfile|launch/hostfiles/2x8gpu|")
    assert first.endswith("|--launcher_args=--ntasks-per-node=8|")
    assert placement == ["node 0: policy stages 0-3 on ranks 0-7",
                         "node 1: policy stages 4-6 on ranks 8-13; reference + evaluator on rank 14; sampler on rank 15"]
    bad = subprocess.run([sys.executable, "-m", "rlft.config.launch_plan", "--config", str(TWO_BY_EIGHT), "topology.nodes=3"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "rlft: config error: topology.nodes: 16 ranks do not split evenly over 3 nodes"


# ---------------------------------------------------------------- refused before any rank starts

TINY = CONFIGS / "grpo_cpu_tiny.yaml"


@pytest.mark.parametrize("overrides,message", [
    (["grpo.group_size=1", "grpo.loss_type=grpo_clip"],
     "grpo.group_size: 1 with grpo.loss_type grpo_clip: the advantage is the reward minus its group's mean, "
     "always 0 in a group of one, so no step has a gradient; set grpo.group_size >= 2 (or "
     "grpo.loss_type=no_baseline)"),
    (["data.train_size=1"],
     "data.train_size: 1 training rows, but every step draws optim.rollout_batch_size / grpo.group_size = 2 "
     "prompts; raise data.train_size or lower optim.rollout_batch_size"),
    (["model.path={tmp}/no_such_model"],
     "model.path: {tmp}/no_such_model does not exist (expected an HF model directory, a .gguf file, a hub id "
     "like 'org/name', or 'smollm2-135m-instruct')"),
    (["model.path={tmp}"],
     "model.path: model directory {tmp} is not a complete HF model: missing config.json and weights "
     "(*.safetensors, pytorch_model*.bin or an index file)"),
])
def test_runs_that_cannot_start_or_learn_are_refused_by_the_plan(tmp_path, capsys, overrides, message):
    from rlft.config.launch_plan import main

    out = tmp_path / "out"
    model = [] if any(o.startswith("model.path=") for o in overrides) else [f"model.path={local_model(tmp_path)}"]
    args = ["--module", "rlft.train_grpo", "--config", str(TINY), f"output.dir={out}", *model,
            "data.source=tests/fixtures/gsm8k"]
    with pytest.raises(SystemExit) as info:
        main(args + [o.format(tmp=tmp_path) for o in overrides])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"rlft: config error: {message.format(tmp=tmp_path)}"]
    assert not out.exists()


def test_the_plan_accepts_what_can_learn(tmp_path, capsys):
    from rlft.config.launch_plan import main

    base = ["--config", str(TINY), f"output.dir={tmp_path}", f"model.path={local_model(tmp_path)}",
            "data.source=tests/fixtures/gsm8k"]
    main(["--module", "rlft.train_grpo", *base, "grpo.group_size=1", "grpo.loss_type=no_baseline",
          "optim.rollout_batch_size=2", "data.train_size=2"])
    # SFT samples no groups (its data on the evaluator's rank, as its record's checks ask)
    main(["--trainer", "sft", *base, "grpo.group_size=1", "topology.sampler_rank=2"])
    assert "world=4" in capsys.readouterr().out


def test_train_sh_refuses_before_any_rank_starts(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run(["bash", str(REPO / "launch" / "train.sh"), str(TINY), f"output.dir={out}",
                          f"model.path={local_model(tmp_path)}", "grpo.group_size=1"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    (line,) = res.stderr.splitlines()
    assert line.startswith("rlft: config error: grpo.group_size: 1 with grpo.loss_type grpo_clip")
    assert not out.exists()


def test_an_override_given_twice_is_refused_before_any_rank_starts(tmp_path):
    # Before, `train.sh CONFIG optim.lr=1e-5 optim.lr=2e-5` trained at 2e-5 and said nothing.
    out, model = tmp_path / "out", local_model(tmp_path)
    t0 = time.monotonic()
    res = subprocess.run(["bash", str(REPO / "launch" / "train.sh"), str(TINY), f"output.dir={out}",
                          f"model.path={model}", "optim.lr=1e-5", "schedule.steps=2", "optim.lr=2e-5"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert (res.returncode, res.stderr.splitlines()) == (2, [
        "rlft: config error: optim.lr: given twice on the command line, as '1e-5' and as '2e-5' (only the last "
        "would count): keep one"])
    assert time.monotonic() - t0 < 60 and not out.exists()
    # A whole section after one of its keys would drop that key; the same value twice loses nothing; a
    # program layering its own overrides (load_config) may still repeat a key.
    from rlft.config.loading import refuse_repeated

    with pytest.raises(ConfigError, match=r"^environment.options: given as '\{y: 2\}' after environment.options.x='1', "
                                          r"which it would replace \(only the last would count\): keep one$"):
        refuse_repeated(["environment.options.x=1", "environment.options={y: 2}"])
    refuse_repeated(["optim.lr=1e-5", "optim.lr= 1e-5", "environment.options={y: 2}", "environment.options.x=1"])
    assert load_config(TINY, ["optim.lr=1e-5", "optim.lr=2e-5"]).optim.lr == 2e-5


def test_the_plan_refuses_a_fresh_run_in_a_used_directory(tmp_path, capsys):
    from rlft.config.launch_plan import main

    ck = tmp_path / "checkpoints" / "step_000006"
    ck.mkdir(parents=True)
    (ck / "trainer_state.json").write_text('{"step": 6}')
    with pytest.raises(SystemExit) as info:
        main(["--module", "rlft.train_grpo", "--config", str(TINY), f"output.dir={tmp_path}",
              f"model.path={local_model(tmp_path)}", "output.resume=never", "data.source=tests/fixtures/gsm8k"])
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"rlft: config error: output.resume: never starts a fresh run, but output.dir {tmp_path} "
                           f"holds another run's checkpoints/")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["checkpoints", "step_000006", "trainer_state.json"]


def test_the_plan_loads_neither_torch_nor_the_model_libraries(tmp_path):
    """The plan's checks (the config, the starting model's directory, the checkpoint a launch would resume)
    run on the launching shell before any rank starts: a mistake is refused in a second, not after torch
    has loaded."""
    from rlft.config.resume_rules import run_settings

    model, out = tmp_path / "model", tmp_path / "out"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 4}')
    (model / "model.safetensors").write_bytes(EMPTY_SAFETENSORS)
    (model / "tokenizer.json").write_text("{}")
    overrides = [f"output.dir={out}", f"model.path={model}", "data.source=tests/fixtures/gsm8k"]
    ck = out / "checkpoints" / "step_000002"
    ck.mkdir(parents=True)
    (ck / "trainer_state.json").write_text(json.dumps({
        "step": 2, "layout": {"pipeline_stages": 2, "replicas": 1},
        "settings": run_settings(load_config(TINY, overrides))}))
    code = ("import sys\n"
            "from rlft.config.launch_plan import main\n"
            "main(sys.argv[1:])\n"  # accepted: resumes step 2
            "try:\n"
            "    main([*sys.argv[1:], 'seed=7'])\n"  # refused: the checkpoint was trained with seed 0
            "except SystemExit as e:\n"
            "    print('exit', e.code)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'deepspeed', 'numpy'}))")
    res = subprocess.run([sys.executable, "-c", code, "--module", "rlft.train_grpo", "--config", str(TINY),
                          *overrides], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("world=4 nodes=1 per_node=4")
    assert "was trained with other settings, which cannot change when a run resumes: seed 0 -> 7" in res.stderr
    assert res.stdout.splitlines()[-2:] == ["exit 2", "[]"]


def test_the_eval_scripts_examples_name_where_a_run_writes_its_model():
    # A run writes its final model to runs/NAME/model (README, "What a run writes").
    header = [line for line in (REPO / "launch" / "eval.sh").read_text().splitlines() if line.startswith("#")]
    paths = [word for line in header for word in line.split() if word.startswith("runs/")]
    assert paths and all(re.fullmatch(r"runs/[\w.-]+/model", p) for p in paths), paths


def test_demo_curve_step_reads_where_the_grpo_stage_writes():
    # launch/demo.sh passes its arguments to the GRPO stage; its curve step must read the directory
    # that stage wrote: the config's output.dir, or the output.dir= argument (given twice, the stage refuses it).
    def grpo_dir(*args: str) -> str:
        res = subprocess.run(["bash", str(REPO / "launch" / "demo.sh"), "--grpo-dir", *args], cwd=REPO,
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        return res.stdout.strip()

    assert grpo_dir() == load_config(CONFIGS / "grpo_cpu_demo.yaml").output.dir == "runs/demo/grpo"
    assert grpo_dir("schedule.steps=2") == "runs/demo/grpo"
    assert grpo_dir("optim.lr=1e-6", "output.dir=runs/my demo") == "runs/my demo"
