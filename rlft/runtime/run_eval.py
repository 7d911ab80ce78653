"""Evaluation as the runtime calls it: during training (the evaluator rank scores the eval split
with its resident engine) and by the entry rule (an output that already holds a trained model is
evaluated instead of trained)."""
from __future__ import annotations

import sys
from pathlib import Path

from rlft.common import log
from rlft.runtime.build import engine_for_run, prompt_limit
from rlft.runtime.context import RankContext


def run_evaluation(ctx: RankContext, step: int) -> dict:
    """The evaluator scores the eval split; results land in OUT/eval/step_N/ (every rank calls it).

    An evaluation that fails does not stop the run: the evaluator says why in one line, the step
    records `eval/failed`, training and checkpoints go on, and every rank exits with status 1 at
    the end (`ctx.exit_code`)."""
    metrics, failure = {}, None
    if ctx.evaluator is not None:
        try:
            with ctx.timed("eval"):
                summary = ctx.evaluator.evaluate(f"step_{step:06d}")
            metrics = {f"eval/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float))}
        except Exception as e:  # noqa: BLE001 - whatever broke the evaluation, the training is kept
            failure = f"{type(e).__name__}: {' '.join(str(e).split())}"
            print(f"rlft: evaluation at step {step} failed: {failure}; training goes on, checkpoints and "
                  f"{Path(ctx.cfg.output.dir) / 'model'} are written as usual, and the run will exit with status 1",
                  file=sys.stderr, flush=True)
            metrics = {"eval/failed": 1.0}
    if ctx.bridge.broadcast_object(failure, src=ctx.cfg.topology.evaluator_rank) is not None:
        ctx.exit_code = 1
    return metrics


def evaluate_existing(ctx: RankContext, model_dir: Path) -> None:
    """Entry rule: the output already holds a trained model -> evaluate it into OUT/eval/final/."""
    from rlft.roles.evaluator import Evaluator

    if ctx.roles.evaluator:
        log.info("%s already holds a trained model: evaluating it instead of training", model_dir)
        limit = prompt_limit(ctx.cfg, str(model_dir), evaluation=True)
        engine = engine_for_run(ctx, str(model_dir))
        ctx.evaluator = Evaluator(ctx.cfg, engine, ctx.tokenizer, max_prompt_tokens=limit)
        summary = ctx.evaluator.evaluate("final", progress=True)
        log.info("evaluation of %s: accuracy %.4f, format %.4f -> %s", model_dir, summary["accuracy"],
                 summary["format_rate"], Path(ctx.cfg.output.dir) / "eval" / "final")
    ctx.bridge.barrier()
