"""Summarise a `benchmarks/learning.sh` output directory: held-out accuracy before/after GRPO with
significance tests, reward curves as PNG, and `learning.json`.

    python benchmarks/learning_summary.py OUT [--demo RUN_DIR] [--json PATH]

Before = the evaluation at step 0 of the GRPO run (the SFT model, same engine and settings),
after = its last evaluation.  Two tests, both two-sided:
* the two-proportion z-test (pooled), treating the two evaluations as independent samples;
* McNemar's exact test on the same questions (paired: only questions whose outcome changed count).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlft.curves import (paired_change, plot_runs, question_outcomes, read_evals, read_steps,  # noqa: E402
                         summarize, two_proportion_p)


def compare(run_dir: Path) -> dict | None:
    evals = read_evals(run_dir)
    if len(evals) < 2:
        return None
    (s0, first), (s1, last) = evals[0], evals[-1]
    n0, n1 = first["num_examples"], last["num_examples"]
    k0, k1 = round(first["accuracy"] * n0), round(last["accuracy"] * n1)
    out = {"n": n1, "before": first["accuracy"], "after": last["accuracy"], "before_step": s0, "after_step": s1,
           "p_value": two_proportion_p(k0, n0, k1, n1), "format_before": first.get("format_rate"),
           "format_after": last.get("format_rate")}
    try:
        a = question_outcomes(run_dir / "eval" / f"step_{s0:06d}")
        b = question_outcomes(run_dir / "eval" / f"step_{s1:06d}")
    except (OSError, KeyError, json.JSONDecodeError):
        a = b = None
    if a and b:
        change = paired_change(a, b)
        out.update(gained=change["gained"], lost=change["lost"], p_value_mcnemar=change["p_value_mcnemar"])
    return out


def step_stats(run_dir: Path) -> dict:
    steps = read_steps(run_dir)
    s = summarize(steps, read_evals(run_dir))

    def mean(key):
        vals = [r[key] for r in steps if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else None
    s.update(zero_variance_group_fraction=mean("batch/zero_variance_group_fraction"),
             groups_generated_per_step=mean("dynamic_sampling/groups_generated"),
             groups_informative_per_step=mean("dynamic_sampling/groups_informative"),
             sampling_rounds_per_step=mean("dynamic_sampling/rounds"),
             seconds_per_step=mean("time/step"))
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--demo", help="a CPU demo run directory to include as demo_cpu")
    p.add_argument("--json", help="where to write learning.json (default OUT/learning.json)")
    args = p.parse_args(argv)
    out = Path(args.out)
    result: dict = {}
    # OUT/commands.json, when present, maps "gsm8k"/"easy" to the command that made the run.
    commands = json.loads((out / "commands.json").read_text()) if (out / "commands.json").is_file() else {}
    for key, run in (("gsm8k", out / "grpo_gsm8k"), ("easy", out / "grpo_easy"),
                     ("gsm8k_instruct", out / "grpo_instruct")):
        if not (run / "steps.jsonl").is_file():
            continue
        entry = compare(run) or {}
        stats = step_stats(run)
        entry.update(steps=stats["steps"], training=stats)
        if stats.get("seconds_per_step") and stats.get("steps"):
            entry["minutes"] = round(sum(r.get("time/step", 0.0) for r in read_steps(run)) / 60, 2)
        cfg = run / "config.yaml"
        if cfg.is_file():
            import yaml

            c = yaml.safe_load(cfg.read_text())
            entry["data"] = c["data"]["source"]
            entry["model"] = c["model"]["path"]
            if key == "easy":
                entry["task"] = c["data"]["source"]
        if key in commands:
            entry["command"] = commands[key]
        result[key] = entry
        png = plot_runs([run], out / f"reward_curve_{key}.png", title=f"GRPO on {key}")
        print(f"{key}: {json.dumps({k: v for k, v in entry.items() if k != 'training'})}\n  curve: {png}")
    if args.demo:
        s = summarize(read_steps(args.demo), read_evals(args.demo))
        result["demo_cpu"] = {k: s.get(k) for k in ("steps", "reward_first", "reward_last", "accuracy_first",
                                                     "accuracy_last", "eval_n")}
        if "demo_cpu" in commands:
            result["demo_cpu"]["command"] = commands["demo_cpu"]
    path = Path(args.json) if args.json else out / "learning.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
