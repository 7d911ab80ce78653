"""Learning curves of a run: a PNG next to its TensorBoard logs, a one-line before/after summary,
and the significance tests used to compare two evaluations.

    python -m rlft.curves runs/demo              # writes runs/demo/reward_curve.png, prints the summary
    python -m rlft.curves runs/a runs/b --out curves.png --json summary.json
    python -m rlft.curves runs/a runs/b --minutes accuracy.png   # held-out accuracy against minutes of training

Reads only what a run writes anyway (`steps.jsonl`, `eval/*/summary.json`), so it works on a live
run, a finished one, or records copied off another machine.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

# (key in steps.jsonl, label) of the curves drawn, in order; absent keys are skipped.  With dynamic
# sampling the batch's own rewards favour groups whose rewards differ; the *_all curves are over
# every response the step generated.
CURVES = (("reward/mean", "reward (trained batch)"), ("reward/answer", "answer (trained batch)"),
          ("reward/format", "format (trained batch)"), ("dynamic_sampling/reward_all", "reward (all sampled)"))
STYLES = {"reward/mean": "--"}
LENGTH = "response_length/mean"  # drawn on a second axis, in tokens


def read_steps(run_dir: str | Path) -> list[dict]:
    """The run's step records, one per step (the last record wins where a step repeats, as after a
    resume from an older checkpoint); a torn last line of a live run is ignored."""
    path = Path(run_dir) / "steps.jsonl"
    by_step: dict[int, dict] = {}
    if not path.is_file():
        return []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def read_evals(run_dir: str | Path) -> list[tuple[int, dict]]:
    """(step, summary) of every held-out evaluation the run wrote, in step order."""
    out = []
    for summary in sorted((Path(run_dir) / "eval").glob("step_*/summary.json")):
        try:
            out.append((int(summary.parent.name.removeprefix("step_")), json.loads(summary.read_text())))
        except (ValueError, json.JSONDecodeError):
            continue
    return sorted(out, key=lambda x: x[0])


def _pyplot():
    """matplotlib's pyplot, drawing to files only (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out_png: str | Path) -> Path:
    """Write `fig` to `out_png` (its folder made) and close it."""
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    _pyplot().close(fig)
    return out_png


def accuracy_by_minutes(run_dir: str | Path) -> list[dict]:
    """Held-out accuracy against minutes of training: for every evaluation of the run, its step, the
    minutes of the steps up to it (each step's `time/step` without its own evaluation's `time/eval`)
    and its accuracy (strict; `accuracy_lenient` too where the summary has it)."""
    steps = read_steps(run_dir)
    minutes, spent = {}, 0.0
    for rec in steps:
        spent += float(rec.get("time/step", 0.0)) - float(rec.get("time/eval", 0.0))
        minutes[rec["step"]] = spent / 60
    points = []
    for step, summary in read_evals(run_dir):
        point = {"step": step, "minutes": round(minutes.get(step, 0.0), 2), "accuracy": summary.get("accuracy")}
        if summary.get("accuracy_lenient") is not None:
            point["accuracy_lenient"] = summary["accuracy_lenient"]
        points.append(point)
    return points


def plot_accuracy_vs_minutes(runs: dict[str, str | Path], out_png: str | Path, *, title: str | None = None) -> Path:
    """One panel: each run's held-out accuracy (markers joined) against its minutes of training."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, (name, run) in enumerate(runs.items()):
        points = accuracy_by_minutes(run)
        if points:
            ax.plot([p["minutes"] for p in points], [100 * p["accuracy"] for p in points], "o-", color=f"C{i}",
                    label=name)
    ax.set_xlabel("minutes of training (evaluations left out)")
    ax.set_ylabel("held-out accuracy, %")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return _save(fig, out_png)


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values (the first points average what exists so far)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def summarize(steps: list[dict], evals: list[tuple[int, dict]], *, edge: int | None = None) -> dict:
    """Reward of the first vs the last `edge` steps (a third of the run, 1 to 5 steps), and held-out
    accuracy of the first vs the last evaluation."""
    rewards = [float(s["reward/mean"]) for s in steps if isinstance(s.get("reward/mean"), (int, float))]
    out: dict = {"steps": len(rewards)}  # training steps (a step-0 record holds only an evaluation)
    if rewards:
        k = edge or max(1, min(5, len(rewards) // 3))
        out.update(edge_steps=k, reward_first=sum(rewards[:k]) / k, reward_last=sum(rewards[-k:]) / k)
        answers = [float(s["reward/answer"]) for s in steps if isinstance(s.get("reward/answer"), (int, float))]
        if len(answers) == len(rewards) and answers != rewards:  # a shaped reward: the answer part alone too
            out.update(answer_first=sum(answers[:k]) / k, answer_last=sum(answers[-k:]) / k)
    if evals:
        (s0, first), (s1, last) = evals[0], evals[-1]
        out.update(eval_first_step=s0, eval_last_step=s1, accuracy_first=first.get("accuracy"),
                   accuracy_last=last.get("accuracy"), eval_n=last.get("num_examples", last.get("n")))
    return out


def two_proportion_p(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided p-value of the pooled two-proportion z-test (1.0 when both rates are 0 or 1)."""
    p = (k1 + k2) / (n1 + n2)
    se = math.sqrt(p * (1 - p) * (1 / n1 + 1 / n2))
    if se == 0:
        return 1.0
    z = (k2 / n2 - k1 / n1) / se
    return math.erfc(abs(z) / math.sqrt(2))


def mcnemar_exact_p(gained: int, lost: int) -> float:
    """Two-sided exact McNemar p-value: binomial(gained + lost, 1/2) tail, doubled, capped at 1."""
    n = gained + lost
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(0, min(gained, lost) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def question_outcomes(eval_dir: str | Path) -> dict[int, bool] | None:
    """Question index -> answered right, from an evaluation's per-question file (`results.jsonl`,
    or `per_question.jsonl` as results keep it); None when it has neither."""
    for name in ("results.jsonl", "per_question.jsonl"):
        path = Path(eval_dir) / name
        if path.is_file():
            rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
            return {r["index"]: r["answer_reward"] >= 1.0 for r in rows}
    return None


def paired_change(before: dict[int, bool], after: dict[int, bool]) -> dict:
    """McNemar's exact test on the questions both evaluated: how many `after` got right that `before`
    did not (gained), and the other way (lost)."""
    common = before.keys() & after.keys()
    gained = sum(1 for i in common if after[i] and not before[i])
    lost = sum(1 for i in common if before[i] and not after[i])
    return {"n": len(common), "gained": gained, "lost": lost, "p_value_mcnemar": mcnemar_exact_p(gained, lost)}


def summary_line(name: str, s: dict) -> str:
    parts = [f"{name}: {s['steps']} steps"]
    if "reward_first" in s:
        parts.append(f"reward {s['reward_first']:.3f} (first {s['edge_steps']}) -> {s['reward_last']:.3f} "
                     f"(last {s['edge_steps']})")
    if "answer_first" in s:
        parts.append(f"right answers {s['answer_first']:.3f} -> {s['answer_last']:.3f}")
    if s.get("accuracy_first") is not None:
        parts.append(f"held-out accuracy {s['accuracy_first']:.3f} (step {s['eval_first_step']}) -> "
                     f"{s['accuracy_last']:.3f} (step {s['eval_last_step']})")
    return " | ".join(parts)


def plot_runs(runs: list[str | Path], out_png: str | Path, *, title: str | None = None, window: int = 5,
              titles: list[str] | None = None) -> Path:
    """One panel of reward curves (raw and smoothed) per run, held-out accuracy as markers, and the mean
    response length on a second axis.  Each panel's title: `titles[i]`, else `title`, else the run's
    directory name."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(runs), figsize=(6.4 * len(runs), 5.0), squeeze=False)
    for i_run, (ax, run) in enumerate(zip(axes[0], runs)):
        steps, evals = read_steps(run), read_evals(run)
        for i, (key, label) in enumerate(CURVES):
            # Only the steps that logged this value (a step-0 record holds just an evaluation).
            points = [(s["step"], float(s[key])) for s in steps
                      if isinstance(s.get(key), (int, float)) and math.isfinite(s[key])]
            if not points:
                continue
            x, y = zip(*points)
            color = f"C{i}"
            ax.plot(x, y, color=color, alpha=0.25, linewidth=1)
            ax.plot(x, moving_average(list(y), window), color=color, linewidth=2, linestyle=STYLES.get(key, "-"),
                    zorder=3 if key in STYLES else 2, label=f"{label} (mean of {window} steps)")
        if evals:
            ax.plot([s for s, _ in evals], [e.get("accuracy", 0.0) for _, e in evals], "ks--", markersize=5,
                    label="held-out accuracy")
        lengths = [(s["step"], float(s[LENGTH])) for s in steps
                   if isinstance(s.get(LENGTH), (int, float)) and math.isfinite(s[LENGTH])]
        handles, labels = ax.get_legend_handles_labels()
        if lengths:
            twin = ax.twinx()
            x, y = zip(*lengths)
            twin.plot(x, moving_average(list(y), window), color="0.55", linewidth=1.5, linestyle=":",
                      label=f"response tokens (mean of {window} steps)")
            twin.set_ylabel("response tokens")
            twin.set_ylim(bottom=0)
            more_handles, more_labels = twin.get_legend_handles_labels()
            handles, labels = handles + more_handles, labels + more_labels
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(titles[i_run] if titles else title or Path(run).name)
        # One legend for both axes, under the panel: inside it would hide some of the curves.
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8)
    return _save(fig, out_png)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlft.curves", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="run output directories (each holds steps.jsonl)")
    p.add_argument("--out", help="PNG path (default: RUN/reward_curve.png for a single run)")
    p.add_argument("--json", help="also write the summaries here")
    p.add_argument("--title")
    p.add_argument("--minutes", metavar="PNG", help="draw held-out accuracy against minutes of training here "
                   "(each run's evaluations), and print the points")
    args = p.parse_args(argv)
    missing = [r for r in args.runs if not (Path(r) / "steps.jsonl").is_file()]
    if missing:
        print(f"rlft.curves: no steps.jsonl in {', '.join(missing)}")
        return 2
    if args.minutes:
        for r in args.runs:
            points = ", ".join(f"{p['minutes']:g} min {100 * p['accuracy']:.1f} %" for p in accuracy_by_minutes(r))
            print(f"{r}: {points or 'no evaluation'}")
        print(f"accuracy against minutes: {plot_accuracy_vs_minutes({str(r): r for r in args.runs}, args.minutes, title=args.title)}")
        if not args.out:
            return 0
    out = args.out or (str(Path(args.runs[0]) / "reward_curve.png") if len(args.runs) == 1 else None)
    if out is None:
        p.error("--out is needed with several runs")
    summaries = {}
    for r in args.runs:
        summaries[str(r)] = summarize(read_steps(r), read_evals(r))
        print(summary_line(str(r), summaries[str(r)]))
    print(f"reward curve: {plot_runs(args.runs, out, title=args.title)}")
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
