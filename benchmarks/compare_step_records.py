"""The same seeded CPU launches on two revisions of rlft, their records compared value by value.

    python benchmarks/compare_step_records.py --base a5a3055 [--head .] [--launches grpo,tools,sft,async,gspo]
                                              [--work /tmp/rlft-compare] [--json PATH]

A revision is a commit (checked out with `git worktree add --detach` under WORK/revs/, once, and kept for
the next comparison: `git worktree remove WORK/revs/SHA` when done) or a directory holding a checkout (`.`, the default head: this one, uncommitted changes included).  Both run
every launch with the same models, data and overrides, each through its own `launch/train.sh` or
`launch/sft.sh`; then every value of every step of OUT/steps.jsonl, and of every evaluation's
summary.json and results.jsonl, is compared exactly (floats too), except what measures time or memory
(`time` and the `time/`, `throughput/`, `memory/` keys, `seconds`, `examples_per_s`).  A key one side lacks counts
as a difference.  The trained model each launch saves (OUT/model/*.safetensors) is compared tensor by
tensor too, exactly, and counted apart (tensors and their values).  The models are built once under WORK/models (the tests' taught tiny models:
tests/conftest.py's taught_sums, tests/test_tool_run.py's calculator model), so both sides load the
same weights.

Launches (each a few CPU minutes at most):
  grpo    launch/configs/grpo_cpu_tiny.yaml as shipped (4 ranks: a 2-stage pipeline, reference +
          evaluator, sampler), 3 steps, evaluations at steps 2 and 3
  tools   the calculator (environment.name=calculator, chat prompt, boxed answers): multi-turn episodes
  sft     launch/configs/sft_cpu_tiny.yaml as shipped
  async   grpo_cpu_tiny on 2 ranks with schedule.max_staleness=1 (batches collected ahead) and dynamic
          sampling
  gspo    grpo_cpu_tiny on 2 ranks with grpo.loss_type=gspo

Prints, per launch, how many values were compared and which differ; exits 1 when any differs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

TIMING_PREFIXES = ("time/", "throughput/", "memory/", "eval/seconds", "eval/examples_per_s")
TIMING_KEYS = {"time", "seconds", "examples_per_s"}  # "time": when the step was logged
TWO_RANKS = ("topology.policy_ranks=[0]", "topology.pipeline_stages=1", "topology.sampler_rank=1",
             "topology.reference_rank=1", "topology.evaluator_rank=1")
SUMS_RUN = ("sampling.repetition_penalty=1.0", "data.prompt_template=r1_short", "schedule.steps=3",
            "schedule.log_samples_every=1", "seed=3")
TOOLS_RUN = (*TWO_RANKS, "data.prompt_template=chat", "reward.answer_format=boxed", "reward.format_weight=0",
             "data.train_size=64", "data.eval_size=4", "environment.name=calculator", "environment.max_turns=3",
             "environment.max_episode_tokens=64", "sampling.max_tokens=24", "sampling.eval_max_tokens=24",
             "sampling.temperature=1.0", "sampling.repetition_penalty=1.0", "grpo.loss_type=grpo_clip",
             "grpo.group_size=8", "grpo.kl_coef=0", "optim.rollout_batch_size=32", "optim.train_micro_batch_size=32",
             "optim.lr=3e-4", "schedule.steps=3", "schedule.evaluate_freq=0", "schedule.save_every=0",
             "schedule.log_samples_every=1", "grpo.mismatch_metrics_every=1", "seed=0")


def launches(models: dict) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """name -> (launcher script, config, overrides)."""
    sums = (f"model.path={models['sums_model']}", f"data.source={models['sums_data']}", *SUMS_RUN)
    return {
        "grpo": ("train.sh", "grpo_cpu_tiny.yaml", sums),
        "tools": ("train.sh", "grpo_cpu_tiny.yaml",
                  (f"model.path={models['tool_model']}", f"data.source={models['tool_data']}", *TOOLS_RUN)),
        "sft": ("sft.sh", "sft_cpu_tiny.yaml",
                (f"model.path={models['sums_model']}", f"data.source={REPO / 'tests' / 'fixtures' / 'gsm8k'}")),
        "async": ("train.sh", "grpo_cpu_tiny.yaml",
                  (*sums, *TWO_RANKS, "schedule.max_staleness=1", "grpo.dynamic_sampling=true",
                   "grpo.max_sampling_rounds=3", "schedule.save_every=0")),
        "gspo": ("train.sh", "grpo_cpu_tiny.yaml", (*sums, *TWO_RANKS, "grpo.loss_type=gspo", "schedule.save_every=0")),
    }


def build_models(root: Path) -> dict:
    """The taught tiny models and their data, built once (a file records where they are)."""
    record = root / "models.json"
    if record.exists():
        return json.loads(record.read_text())
    from conftest import taught_sums
    from test_tool_run import taught_tool_use

    sums_model, sums_data = taught_sums(root / "sums", teach_steps=100, test_size=4)
    tool_model, tool_data, _ = taught_tool_use(root / "tools")
    models = {"sums_model": str(sums_model), "sums_data": str(sums_data), "tool_model": str(tool_model),
              "tool_data": str(tool_data)}
    record.write_text(json.dumps(models))
    return models


def checkout(rev: str, work: Path) -> Path:
    """The directory of revision `rev`: a directory as given, or a commit checked out under WORK/revs/."""
    if Path(rev).is_dir():
        return Path(rev).resolve()
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                         capture_output=True, text=True, check=True).stdout.strip()
    path = work / "revs" / sha[:12]
    if not path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), sha], check=True,
                       capture_output=True)
    return path


def run_launch(tree: Path, out: Path, launcher: str, config: str, overrides: tuple[str, ...]) -> float:
    """One launch of `tree`'s launcher into `out` (fresh); its seconds.  RuntimeError with its log's tail."""
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(RLFT_PROGRESS="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    t0 = time.time()
    res = subprocess.run(["bash", str(tree / "launch" / launcher), str(tree / "launch" / "configs" / config),
                          *overrides, f"output.dir={out}"], cwd=tree, env=env, capture_output=True, text=True,
                         timeout=1200)
    if res.returncode != 0:
        raise RuntimeError(f"{tree} {launcher} {config} failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return time.time() - t0


def records(out: Path) -> dict[str, object]:
    """What a launch wrote that is compared: steps.jsonl by step, each evaluation's summary and results."""
    found: dict[str, object] = {}
    for line in (out / "steps.jsonl").read_text().splitlines():
        row = json.loads(line)
        found[f"steps.jsonl step {row.get('step')}"] = row
    for path in sorted((out / "eval").glob("*/*")) if (out / "eval").exists() else []:
        if path.name == "summary.json":
            found[f"eval/{path.parent.name}/summary"] = json.loads(path.read_text())
        elif path.name == "results.jsonl":
            found[f"eval/{path.parent.name}/results"] = [json.loads(x) for x in path.read_text().splitlines()]
    return found


def weights(out: Path) -> dict:
    """The saved model's tensors by name (OUT/model/*.safetensors; empty when none was saved)."""
    from safetensors.torch import load_file

    found = {}
    for path in sorted((out / "model").glob("*.safetensors")):
        found.update(load_file(str(path)))
    return found


def compare_weights(a: dict, b: dict, where: str, diffs: list[str]) -> tuple[int, int]:
    """(tensors, values) compared; each tensor that differs (or that one side lacks) appended to `diffs`."""
    import torch

    tensors = values = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            diffs.append(f"{where}/weights/{name}: only in {'head' if name in b else 'base'}")
            continue
        tensors, values = tensors + 1, values + a[name].numel()
        if a[name].shape != b[name].shape or not torch.equal(a[name], b[name]):
            diffs.append(f"{where}/weights/{name}: differs")
    return tensors, values


def is_timing(key: str) -> bool:
    return key in TIMING_KEYS or key.startswith(TIMING_PREFIXES)


def compare(a: object, b: object, where: str, diffs: list[str]) -> int:
    """The number of leaf values compared under `where`; each difference appended to `diffs`."""
    if isinstance(a, dict) and isinstance(b, dict):
        n = 0
        for key in sorted(set(a) | set(b)):
            if is_timing(key):
                continue
            if key not in a or key not in b:
                diffs.append(f"{where}/{key}: only in {'head' if key in b else 'base'}")
                n += 1
                continue
            n += compare(a[key], b[key], f"{where}/{key}", diffs)
        return n
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            diffs.append(f"{where}: {len(a)} items in base, {len(b)} in head")
            return 1
        return sum(compare(x, y, f"{where}[{i}]", diffs) for i, (x, y) in enumerate(zip(a, b)))
    same = a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    if not same:
        diffs.append(f"{where}: base {a!r} head {b!r}")
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="a commit or a checkout directory")
    p.add_argument("--head", default=str(REPO), help="a commit or a checkout directory (default: this checkout)")
    p.add_argument("--launches", default="grpo,tools,sft,async,gspo")
    p.add_argument("--work", default="/tmp/rlft-compare")
    p.add_argument("--json", default=None, help="write the figures and the differences here")
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    table = launches(build_models(work / "models"))
    names = [n for n in args.launches.split(",") if n]
    unknown = [n for n in names if n not in table]
    if unknown:
        p.error(f"--launches: unknown {unknown}; choose from {sorted(table)}")
    trees = {side: checkout(rev, work) for side, rev in (("base", args.base), ("head", args.head))}
    report, failed = {}, False
    for name in names:
        launcher, config, overrides = table[name]
        got, saved = {}, {}
        for side, tree in trees.items():
            seconds = run_launch(tree, work / "runs" / side / name, launcher, config, overrides)
            got[side], saved[side] = records(work / "runs" / side / name), weights(work / "runs" / side / name)
            print(f"[{name}] {side} ({tree}): {seconds:.0f} s", flush=True)
        diffs: list[str] = []
        n = compare(got["base"], got["head"], name, diffs)
        tensors, values = compare_weights(saved["base"], saved["head"], name, diffs)
        report[name] = {"compared": n, "weight_tensors": tensors, "weight_values": values, "differing": len(diffs),
                        "differences": diffs}
        failed |= bool(diffs)
        print(f"[{name}] {n} record values and {tensors} weight tensors ({values} values) compared, "
              f"{len(diffs)} differ", flush=True)
        for d in diffs[:30]:
            print(f"    {d}")
    total, tensors = sum(r["compared"] for r in report.values()), sum(r["weight_tensors"] for r in report.values())
    values = sum(r["weight_values"] for r in report.values())
    print(f"all: {total} record values and {tensors} weight tensors ({values} values) compared, "
          f"{sum(r['differing'] for r in report.values())} differ")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
