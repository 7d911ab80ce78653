"""Summarise `benchmarks/instruct_ablation.sh`'s arms: each arm's steps and training minutes, its
median sample and weight-sync seconds (steps 2 on: the first step warms the engine up), its
final held-out accuracy (strict and lenient), and McNemar's exact test against the first arm on the
same questions (and, with --before, against the starting model's evaluation).

    python benchmarks/ablation_summary.py OUT --arms shipped no_overlong ... [--before DIR] [--json PATH]

OUT/<arm>/ are the runs; the first arm named is the baseline.  An arm named NAME=DIR is the run in
DIR (relative to OUT, or absolute): an arm run again on its own, e.g. difficulty=../again/difficulty.
An arm without an evaluation (it failed) is listed with what it has.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlft.curves import paired_change, question_outcomes, read_evals, read_steps  # noqa: E402


def arm_result(run: Path) -> dict:
    steps = [r for r in read_steps(run) if r.get("step", 0) >= 1] if (run / "steps.jsonl").is_file() else []
    evals = read_evals(run) if run.is_dir() else []
    out = {"steps": len(steps), "training_minutes": round(sum(r.get("time/step", 0.0) for r in steps) / 60, 2)}
    for key in ("sample", "sync"):
        seconds = [r[f"time/{key}"] for r in steps if r["step"] >= 2 and f"time/{key}" in r]
        out[f"{key}_s"] = round(statistics.median(seconds), 3) if seconds else None
    if evals:
        step, last = evals[-1]
        out.update(eval_step=step, accuracy=last.get("accuracy"), accuracy_lenient=last.get("accuracy_lenient"),
                   n=last.get("num_examples"), format_rate=last.get("format_rate"))
        out["outcomes_dir"] = str(run / "eval" / f"step_{step:06d}")
    return out


def arm_dirs(root: Path, arms: list[str]) -> dict[str, Path]:
    """Arm name -> its run: OUT/NAME, or DIR for NAME=DIR (relative to OUT, or absolute)."""
    return {arm.partition("=")[0]: root / (arm.partition("=")[2] or arm) for arm in arms}


def summarise(root: Path, arms: list[str], before: Path | None) -> dict:
    results = {arm: arm_result(run) for arm, run in arm_dirs(root, arms).items()}
    outcomes = {arm: question_outcomes(r["outcomes_dir"]) if "outcomes_dir" in r else None
                for arm, r in results.items()}
    start = question_outcomes(before) if before is not None else None
    base = next(iter(results))
    for arm, r in results.items():
        if outcomes[arm] and outcomes[base] and arm != base:
            r["vs_" + base] = paired_change(outcomes[base], outcomes[arm])  # gained: right here, wrong there
        if outcomes[arm] and start:
            r["vs_start"] = paired_change(start, outcomes[arm])
        r.pop("outcomes_dir", None)
    return {"baseline": base, "before": str(before) if before else None, "arms": results}


def table(summary: dict) -> str:
    base = summary["baseline"]
    lines = [f"{'arm':<22} {'steps':>5} {'min':>6} {'sample s':>8} {'sync s':>7} {'strict':>8} {'lenient':>8}"
             f"   vs {base}: gained/lost, p"
             + ("   vs start: gained/lost, p" if summary["before"] else "")]
    for arm, r in summary["arms"].items():
        pct = lambda v: f"{100 * v:7.2f}%" if isinstance(v, (int, float)) else f"{'-':>8}"  # noqa: E731
        pair = r.get("vs_" + base)
        vs = f"{pair['gained']}/{pair['lost']}, p={pair['p_value_mcnemar']:.2g}" if pair else ("(baseline)" if arm == base else "-")
        sec = lambda v, w: f"{v:{w}.3f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"  # noqa: E731
        line = (f"{arm:<22} {r['steps']:>5} {r['training_minutes']:>6} {sec(r.get('sample_s'), 8)} {sec(r.get('sync_s'), 7)} "
                f"{pct(r.get('accuracy'))} {pct(r.get('accuracy_lenient'))}   {vs}")
        if summary["before"]:
            s = r.get("vs_start")
            line += f"   {s['gained']}/{s['lost']}, p={s['p_value_mcnemar']:.2g}" if s else "   -"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="instruct_ablation.sh's OUT")
    p.add_argument("--arms", nargs="+", required=True, help="arm names (or NAME=DIR); the first is the baseline")
    p.add_argument("--before", help="an evaluation directory of the starting model (results.jsonl)")
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args(argv)
    summary = summarise(Path(args.root), args.arms, Path(args.before) if args.before else None)
    print(table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if all("accuracy" in r for r in summary["arms"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
