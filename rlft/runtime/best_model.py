"""The best evaluated weights of a run (`output.keep_best`), kept beside the last ones.

    OUT/best_model/             the HF export of the step whose evaluation scored highest so far
        best.json               {"step", "metric", "value", "history"}: which step, by what, and every
                                evaluation's [step, value] of the run

A longer run is not always a better one: held-out accuracy can peak and fall back while the training
reward still rises (a learning rate too high for the recipe did exactly that).  With `output.keep_best`
every evaluation step also saves a checkpoint; after it, rank 0 compares the step's `eval/accuracy`
with the best so far and, when it is strictly higher, copies that checkpoint's HF export to
OUT/best_model (atomically: a crash leaves the previous best whole).  An evaluation of the starting
model (`schedule.evaluate_at_start`) sets the mark to beat but is not copied: it is `model.path`.

A resumed run keeps the best of the steps it resumed after (best.json's step at or before the
checkpoint); a best from a step the run no longer has (it resumed from an earlier checkpoint), or from
an earlier run in an output that starts afresh, is moved aside whole (OUT/best_model.earlier_step_000060 for a best of step 60).

The evaluation split picks the step, so its accuracy at that step is an optimistic estimate: report a
held-out figure from data that did not choose it (`data.eval_split` set to a validation split during
training, the test split evaluated once afterwards with `rlft.evaluate`).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from rlft.common import log
from rlft.config.resume_rules import step_dir

BEST_DIR = "best_model"
BEST_FILE = "best.json"
METRIC = "eval/accuracy"


class BestModel:
    """Rank 0's record of the best evaluation so far, and the copy of its weights in OUT/best_model."""

    def __init__(self, out_dir: str | Path, start: int):
        self.out_dir = Path(out_dir)
        self.dir = self.out_dir / BEST_DIR
        self.step: int | None = None
        self.value = -math.inf
        self.history: list[list[float]] = []  # [step, value] of every evaluation seen
        self.pending: tuple[int, float] | None = None
        stored = read_best(self.dir)
        if stored is None:
            return
        if 0 < start and stored["step"] <= start:
            self.step, self.value = int(stored["step"]), float(stored["value"])
            self.history = [h for h in stored.get("history", []) if h[0] <= start]
            log.info("output.keep_best: %s holds step %d (%s %.4f), the mark to beat", self.dir, self.step,
                     METRIC, self.value)
        else:  # not this run's best: moved aside, whole, so that OUT/best_model only ever holds this run's
            aside = self.out_dir / f"{BEST_DIR}.earlier_step_{int(stored['step']):06d}"
            n = 1
            while aside.exists():
                aside, n = aside.with_name(f"{BEST_DIR}.earlier_step_{int(stored['step']):06d}.{n}"), n + 1
            self.dir.rename(aside)
            log.warning("output.keep_best: %s held step %d of %s; moved to %s", self.dir, stored["step"],
                        "an earlier run in this output (this one starts afresh)" if start == 0
                        else f"steps past the checkpoint this run resumed (step {start})", aside)

    def saw(self, step: int, metrics: dict) -> None:
        """Rank 0 saw `metrics` of `step` (the merged metrics of every rank).  A value higher than every
        earlier one becomes pending until the step's checkpoint is saved (`step_saved`), or, at step 0
        (the starting model, `model.path`), the mark to beat."""
        value = metrics.get(METRIC)
        if value is None or not math.isfinite(value):
            return
        self.history.append([step, float(value)])
        if value <= self.value:
            if self.step:  # best.json keeps every evaluation's value, the ones after the best too
                self._write()
            log.info("output.keep_best: step %d %s %.4f is not above step %s's %.4f; %s kept", step, METRIC,
                     value, self.step, self.value, self.dir if self.dir.is_dir() else "nothing")
            return
        if step == 0:
            self.step, self.value = 0, float(value)
            log.info("output.keep_best: the starting model's %s %.4f is the mark to beat", METRIC, value)
            return
        self.pending = (step, float(value))

    def step_saved(self, step: int) -> None:
        """The step's own save is done (the last step's before its evaluation, another's after its report),
        or it saved nothing (its update was skipped or rolled back): when `step` is pending, copy its
        checkpoint to OUT/best_model, or say why it cannot be kept."""
        if self.pending is None or self.pending[0] != step:
            return
        hf = step_dir(self.out_dir, step) / "hf"
        if not hf.is_dir():
            log.warning("output.keep_best: step %d scored %s %.4f but saved no checkpoint (its update was "
                        "skipped or rolled back); %s is not replaced", step, METRIC, self.pending[1], self.dir)
            self.pending = None
            return
        from rlft.runtime.checkpoint import copy_tree_atomic

        copy_tree_atomic(hf, self.dir)
        self.step, self.value = self.pending
        self.pending = None
        self._write()
        log.info("output.keep_best: step %d %s %.4f is the best so far: %s holds it", self.step, METRIC,
                 self.value, self.dir)

    def _write(self) -> None:
        from rlft.runtime.checkpoint import write_json_atomic

        write_json_atomic(self.dir / BEST_FILE, {"step": self.step, "metric": METRIC, "value": self.value,
                                                 "history": self.history})

    def summary(self) -> str:
        """The run's last word on it: which step was best, against the last evaluation."""
        if self.step is None:
            return "output.keep_best: no evaluation was recorded; OUT/best_model was not written"
        last = self.history[-1] if self.history else None
        where = f"{self.dir}" if self.step > 0 else "the starting model (nothing copied)"
        tail = f"; the last evaluation (step {last[0]}) scored {last[1]:.4f}" if last and last[0] != self.step else ""
        return f"output.keep_best: best {METRIC} {self.value:.4f} at step {self.step}: {where}{tail}"


def read_best(best_dir: str | Path) -> dict | None:
    """best.json of OUT/best_model, or None when there is none (or it is not readable)."""
    path = Path(best_dir) / BEST_FILE
    try:
        data = json.loads(path.read_text())
        int(data["step"]), float(data["value"])
        return data
    except (OSError, ValueError, KeyError, TypeError):
        return None
