"""Two GRPO runs side by side: held-out accuracy at every evaluation, the paired test between them on
the same questions, and what a step cost (seconds per phase, peak memory, sampled tokens/s).

    python benchmarks/compare_runs.py NAME_A=RUN_A NAME_B=RUN_B [--up-to STEP] [--json PATH] [--png PATH]

RUN_* are run directories (`steps.jsonl`, `eval/step_*/`).  `--up-to` counts only the steps both runs
reached: step times and phase means are taken over training steps without an evaluation, so the two
arms are compared on the same questions (same seed, same data order) and the same work.
Arms given equal minutes reach different steps: each arm's last evaluation is also paired with the other's
(`between.last`), the comparison an equal-time budget asks for.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlft.curves import paired_change, plot_runs, question_outcomes, read_evals, read_steps  # noqa: E402

PHASES = ("step", "sample", "grade", "train", "sync")
TOKENS = ("prompt", "generated", "inserted", "response", "total")
MEMORY = ("sample", "sync", "train")


def numbers(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if isinstance(r.get(key), (int, float))]


def mean(rows: list[dict], key: str) -> float | None:
    vals = numbers(rows, key)
    return sum(vals) / len(vals) if vals else None


def median(rows: list[dict], key: str) -> float | None:
    vals = numbers(rows, key)
    return statistics.median(vals) if vals else None


def median_of(rows: list[dict], value) -> float | None:
    """The median of ``value(row)`` over the rows that hold every number it reads."""
    vals = []
    for r in rows:
        try:
            vals.append(value(r))
        except (KeyError, TypeError, ZeroDivisionError):
            continue
    return statistics.median(vals) if vals else None


def arm(run: Path, up_to: int | None) -> dict:
    steps = [r for r in read_steps(run) if r.get("step", 0) >= 1 and (up_to is None or r["step"] <= up_to)]
    plain = [r for r in steps if "eval/accuracy" not in r]  # steps that paid for no evaluation
    evals = [(s, e) for s, e in read_evals(run) if up_to is None or s <= up_to]
    edge = min(10, max(1, len(steps) // 3))
    out = {
        "run": str(run),
        "steps": len(steps),
        "training_minutes": round(sum(r.get("time/step", 0.0) for r in steps) / 60, 2),
        "seconds_median": {p: median(plain, f"time/{p}") for p in PHASES},
        "peak_memory_gib": {p: max((r.get(f"memory/peak_gb/{p}") or 0.0 for r in steps), default=0.0) or None
                            for p in MEMORY},
        "sample_tokens_per_s": mean(plain, "throughput/sample_tokens_per_s"),
        "tokens_median": {k: median(plain, f"tokens/{k}") for k in TOKENS},
        "step_seconds_per_1k_generated": median_of(plain, lambda r: 1000 * r["time/step"] / r["tokens/generated"]),
        "sampling_rounds_per_step": mean(steps, "dynamic_sampling/rounds"),
        "reward_all_first": mean(steps[:edge], "dynamic_sampling/reward_all") or mean(steps[:edge], "reward/mean"),
        "reward_all_last": mean(steps[-edge:], "dynamic_sampling/reward_all") or mean(steps[-edge:], "reward/mean"),
        "entropy_first": mean(steps[:edge], "entropy"),
        "entropy_last": mean(steps[-edge:], "entropy"),
        "edge_steps": edge,
        "evals": {s: {"accuracy": e.get("accuracy"), "format_rate": e.get("format_rate"),
                      "mean_response_length": e.get("mean_response_length")} for s, e in evals},
    }
    if len(evals) >= 2:
        (s0, _), (s1, _) = evals[0], evals[-1]
        first = question_outcomes(run / "eval" / f"step_{s0:06d}")
        last = question_outcomes(run / "eval" / f"step_{s1:06d}")
        if first and last:
            out["first_to_last"] = {"from_step": s0, "to_step": s1, **paired_change(first, last)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("arms", nargs=2, metavar="NAME=RUN_DIR")
    p.add_argument("--up-to", type=int, help="count only steps up to this one (the last both reached)")
    p.add_argument("--json", help="write the comparison here")
    p.add_argument("--png", help="draw both runs' curves side by side here")
    args = p.parse_args(argv)
    named = {}
    for text in args.arms:
        name, sep, path = text.partition("=")
        if not sep or not name or not Path(path, "steps.jsonl").is_file():
            p.error(f"{text!r}: expected NAME=RUN_DIR with a steps.jsonl in RUN_DIR")
        named[name] = Path(path)
    result = {name: arm(run, args.up_to) for name, run in named.items()}
    (na, a), (nb, b) = result.items()
    shared = sorted(set(a["evals"]) & set(b["evals"]))
    between = {}
    for s in shared:
        oa = question_outcomes(named[na] / "eval" / f"step_{s:06d}")
        ob = question_outcomes(named[nb] / "eval" / f"step_{s:06d}")
        if oa and ob:
            between[s] = paired_change(oa, ob)  # gained = right in b, wrong in a
    result["between"] = {"a": na, "b": nb, "at_step": between}
    per_token = (a["step_seconds_per_1k_generated"], b["step_seconds_per_1k_generated"])
    # b's step against a's at equal generated tokens (medians; the bound for tool steps is 1.15)
    result["step_ratio_per_generated_token"] = per_token[1] / per_token[0] if all(per_token) else None
    if a["evals"] and b["evals"]:
        la, lb = max(a["evals"]), max(b["evals"])
        oa = question_outcomes(named[na] / "eval" / f"step_{la:06d}")
        ob = question_outcomes(named[nb] / "eval" / f"step_{lb:06d}")
        if oa and ob:
            result["between"]["last"] = {"a_step": la, "b_step": lb, **paired_change(oa, ob)}

    print(f"{'step':>5} | {na:>10} | {nb:>10} | {nb} vs {na}: gained/lost, McNemar p")
    for s in sorted(set(a["evals"]) | set(b["evals"])):
        acc = [f"{r['evals'][s]['accuracy'] * 100:9.2f}%" if s in r["evals"] else f"{'':>10}" for r in (a, b)]
        pair = between.get(s)
        tail = f"{pair['gained']}/{pair['lost']}, p={pair['p_value_mcnemar']:.2g}" if pair else ""
        print(f"{s:>5} | {acc[0]} | {acc[1]} | {tail}")
    last = result["between"].get("last")
    if last:
        print(f"last evaluations, {na} step {last['a_step']} against {nb} step {last['b_step']}: "
              f"{nb} {last['gained']}/{last['lost']}, p={last['p_value_mcnemar']:.2g}")
    for key in ("steps", "training_minutes", "seconds_median", "peak_memory_gib", "sample_tokens_per_s",
                "tokens_median", "step_seconds_per_1k_generated",
                "sampling_rounds_per_step", "reward_all_first", "reward_all_last", "entropy_first",
                "entropy_last", "first_to_last"):
        print(f"{key}: {na}={a.get(key)}  {nb}={b.get(key)}")
    if result["step_ratio_per_generated_token"] is not None:
        print(f"step per generated token: {nb}/{na} = {result['step_ratio_per_generated_token']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.png:
        print(f"wrote {plot_runs(list(named.values()), args.png, titles=list(named))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
