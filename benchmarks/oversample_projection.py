"""What `grpo.oversample` would have changed in a recorded run with dynamic sampling, replayed from its records.

    python benchmarks/oversample_projection.py RUN [RUN ...] [--oversample auto] [--trials 20] [--json PATH]

Each step of RUN/steps.jsonl kept a share p = groups_informative / groups_generated of the groups it drew.
A trial replays the run with the round sizes `rlft.batching.round_size.RoundSizer` asks for: every round
keeps Binomial(n, p) of its n groups (the step's own p), until the step holds its prompts or
grpo.max_sampling_rounds (RUN/config.yaml) rounds are spent.  Printed per run: rounds and groups drawn a
step, recorded and projected (the mean over trials), and the recorded sample seconds a step scaled two
ways, which bound what the change can do to them:

    latency-bound      a round lasts as long whatever its size (its longest response decides; a small
                       model's decoding on a large GPU): seconds x projected rounds / recorded rounds
    throughput-bound   a round lasts as long as its sequences take (a saturated engine):
                       seconds x projected groups / recorded groups

A projection from measured keep rates, not a measurement: the GPU's answer lies between the bounds.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlft.batching.round_size import RoundSizer  # noqa: E402
from rlft.curves import read_steps  # noqa: E402


def run_settings(run: Path) -> tuple[int, int]:
    """(prompts a step, most rounds a step) from the run's saved config."""
    import yaml

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    return cfg["optim"]["rollout_batch_size"] // cfg["grpo"]["group_size"], cfg["grpo"]["max_sampling_rounds"]


def replay(keep_rates: list[float], per_step: int, max_rounds: int, oversample, rng: random.Random) -> tuple[float, float]:
    """One trial over the steps: (rounds, groups drawn) a step, on average."""
    sizer, rounds, groups = RoundSizer(oversample, per_step), 0, 0
    for p in keep_rates:
        kept = 0
        for _ in range(max_rounds):
            n = sizer.prompts_for(per_step - kept)
            k = sum(1 for _ in range(n) if rng.random() < p)
            sizer.saw(n, k)
            kept, rounds, groups = kept + k, rounds + 1, groups + n
            if kept >= per_step:
                break
    return rounds / len(keep_rates), groups / len(keep_rates)


def project(run: Path, oversample, trials: int, seed: int = 0) -> dict:
    steps = [r for r in read_steps(run) if "dynamic_sampling/groups_generated" in r]
    if not steps:
        raise SystemExit(f"{run}: no step with dynamic sampling's records (dynamic_sampling/groups_generated)")
    per_step, max_rounds = run_settings(run)
    keep = [min(1.0, r["dynamic_sampling/groups_informative"] / r["dynamic_sampling/groups_generated"]) for r in steps]
    rng = random.Random(seed)
    results = [replay(keep, per_step, max_rounds, oversample, rng) for _ in range(trials)]
    rounds = statistics.mean(r for r, _ in results)
    groups = statistics.mean(g for _, g in results)
    recorded_rounds = statistics.mean(r["dynamic_sampling/rounds"] for r in steps)
    recorded_groups = statistics.mean(r["dynamic_sampling/groups_generated"] for r in steps)
    sample = [r["time/sample"] for r in steps if "time/sample" in r]
    out = {"run": str(run), "steps": len(steps), "prompts_per_step": per_step, "oversample": oversample,
           "trials": trials, "keep_rate": sum(r["dynamic_sampling/groups_informative"] for r in steps)
           / sum(r["dynamic_sampling/groups_generated"] for r in steps),
           "recorded": {"rounds": recorded_rounds, "groups": recorded_groups},
           "projected": {"rounds": rounds, "groups": groups}}
    if sample:
        s = statistics.mean(sample)
        out["sample_s"] = {"recorded": s, "latency_bound": s * rounds / recorded_rounds,
                           "throughput_bound": s * groups / recorded_groups}
    return out


def table(rows: list[dict]) -> str:
    lines = ["| run | steps | keep rate | rounds a step | groups a step | sample s: recorded | latency-bound | "
             "throughput-bound |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        s = r.get("sample_s", {})
        sec = (f"{s['recorded']:.2f} | {s['latency_bound']:.2f} | {s['throughput_bound']:.2f}" if s else "- | - | -")
        lines.append(f"| {r['run']} | {r['steps']} | {r['keep_rate']:.3f} | {r['recorded']['rounds']:.2f} -> "
                     f"{r['projected']['rounds']:.2f} | {r['recorded']['groups']:.1f} -> {r['projected']['groups']:.1f} "
                     f"| {sec} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--oversample", default="auto", help="auto or a number >= 1 (grpo.oversample)")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    oversample = args.oversample if args.oversample == "auto" else float(args.oversample)
    if oversample != "auto" and oversample < 1:
        ap.error(f"--oversample: must be a number >= 1 or auto, got {args.oversample}")
    rows = [project(run, oversample, args.trials) for run in args.runs]
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
