"""Evaluation as the runtime calls it: during training (the evaluator rank scores the eval split
with its resident engine) and by the entry rule (an output that already holds a trained model is
evaluated instead of trained)."""
from __future__ import annotations

from pathlib import Path

from rlft.common import log
from rlft.runtime.build import engine_for_run
from rlft.runtime.context import RankContext


def run_evaluation(ctx: RankContext, step: int) -> dict:
    """The evaluator scores the eval split; results land in OUT/eval/step_N/ (every rank calls it)."""
    if ctx.evaluator is None:
        return {}
    with ctx.timed("eval"):
        summary = ctx.evaluator.evaluate(f"step_{step:06d}")
    return {f"eval/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float))}


def evaluate_existing(ctx: RankContext, model_dir: Path) -> None:
    """Entry rule: the output already holds a trained model -> evaluate it into OUT/eval/final/."""
    from rlft.roles.evaluator import Evaluator

    if ctx.roles.evaluator:
        log.info("%s already holds a trained model: evaluating it instead of training", model_dir)
        engine = engine_for_run(ctx, str(model_dir))
        ctx.evaluator = Evaluator(ctx.cfg, engine, ctx.tokenizer)
        summary = ctx.evaluator.evaluate("final", progress=True)
        log.info("evaluation of %s: accuracy %.4f, format %.4f -> %s", model_dir, summary["accuracy"],
                 summary["format_rate"], Path(ctx.cfg.output.dir) / "eval" / "final")
    ctx.bridge.barrier()
