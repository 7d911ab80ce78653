"""Each phase of a GRPO step, median over the steps after the first SKIP, for several runs of the same work,
and every run's ratio to the first run's (benchmarks/same_machine_steps.sh writes the runs):

    python benchmarks/step_phases.py before=RUN_A/steps.jsonl after=RUN_B/steps.jsonl [--skip 1] [--json OUT]

``sample_per_round_s`` is the sample phase divided by its rounds (``dynamic_sampling/rounds``; 1 without
dynamic sampling), the figure to compare where two runs drew a different number of rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PHASES = ("time/step", "time/sample", "time/grade", "time/teacher", "time/train", "time/sync", "tokens/response",
          "throughput/sample_tokens_per_s", "dynamic_sampling/rounds", "memory/peak_gb")


def step_records(path: Path, skip: int) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "time/step" in r and r.get("step", 0) > skip]


def medians(records: list[dict]) -> dict:
    out = {"steps": [r["step"] for r in records]}
    for key in PHASES:
        values = [r[key] for r in records if key in r]
        if values:
            out[key] = statistics.median(values)
    per_round = [r["time/sample"] / r.get("dynamic_sampling/rounds", 1.0) for r in records if "time/sample" in r]
    if per_round:
        out["sample_per_round_s"] = statistics.median(per_round)
    return out


def compare(runs: dict[str, dict]) -> dict:
    first = next(iter(runs.values()))
    ratios = {name: {k: v / first[k] for k, v in m.items() if k != "steps" and first.get(k)} for name, m in runs.items()}
    return {"medians": runs, "ratio_to_first": ratios}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="NAME=steps.jsonl")
    p.add_argument("--skip", type=int, default=1, help="leave out steps 1..SKIP (compile, first wake; default 1)")
    p.add_argument("--json", type=Path, help="write the medians and ratios here")
    args = p.parse_args(argv)
    runs = {}
    for pair in args.runs:
        name, _, path = pair.partition("=")
        records = step_records(Path(path), args.skip)
        if not records:
            raise SystemExit(f"{path}: no step after step {args.skip}")
        runs[name] = medians(records)
    result = compare(runs)
    keys = [k for k in (*PHASES, "sample_per_round_s") if all(k in m for m in runs.values())]
    print(f"{'median':34s}" + "".join(f"{n:>14s}" for n in runs) + "   ratio (last/first)")
    for k in keys:
        vals = [runs[n][k] for n in runs]
        ratio = vals[-1] / vals[0] if vals[0] else float("nan")
        print(f"{k:34s}" + "".join(f"{v:14.3f}" for v in vals) + f"   {ratio:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
