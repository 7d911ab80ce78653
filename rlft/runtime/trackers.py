"""Where a run's scalars and sample texts go besides steps.jsonl (`reporting.trackers`).

* ``tensorboard``: OUT/tensorboard (the default).
* ``wandb``: Weights & Biases, offline by default (OUT/wandb; `wandb sync` uploads it later),
  online with `reporting.wandb_mode: online`.  Needs the package ``wandb``.
* ``mlflow``: MLflow, to a local file store OUT/mlruns unless `reporting.mlflow_tracking_uri`
  names a server.  Needs the package ``mlflow`` (or ``mlflow-skinny``).

Each gets the same scalars at the same steps.  A run continued from a checkpoint goes on with the
same W&B run and MLflow run (their ids are kept in OUT), and logs its steps against a ``step``
metric of its own (W&B would drop steps lower than the highest it saw).
"""
from __future__ import annotations

import html
import os
import secrets
import time
from pathlib import Path



class TensorBoardSink:
    def __init__(self, out_dir: Path, resume_step: int, settings=None):
        from torch.utils.tensorboard import SummaryWriter

        self.where = out_dir / "tensorboard"
        self.writer = SummaryWriter(str(self.where), purge_step=resume_step + 1 if resume_step else 0)

    def scalars(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def text(self, tag: str, step: int, text: str) -> None:
        self.writer.add_text(tag, text, step)

    def close(self) -> None:
        self.writer.close()

    def describe(self) -> str:
        return f"TensorBoard: tensorboard --logdir {self.where}"


def _run_id(path: Path, make) -> str:
    """The id kept in `path` (a run continued from a checkpoint goes on with it), else a new one."""
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = make()
    path.write_text(run_id + "\n")
    return run_id


class WandbSink:
    def __init__(self, out_dir: Path, resume_step: int, settings):
        import wandb

        self.wandb = wandb
        self.where = out_dir / "wandb"
        self.where.mkdir(parents=True, exist_ok=True)
        run_id = _run_id(out_dir / ".wandb_run_id", lambda: secrets.token_hex(4))
        self.run = wandb.init(project=settings.project, name=settings.run_name or out_dir.name, id=run_id,
                              resume="allow", dir=str(out_dir), mode=settings.wandb_mode,
                              settings=wandb.Settings(silent=True, console="off"))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def scalars(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({**metrics, "step": step})

    def text(self, tag: str, step: int, text: str) -> None:
        self.run.log({tag: self.wandb.Html(f"<pre>{html.escape(text)}</pre>"), "step": step})

    def close(self) -> None:
        self.run.finish()

    def describe(self) -> str:
        if self.run.settings.mode == "offline":
            return f"Weights & Biases (offline): {self.where}; upload with `wandb sync {self.where}/offline-run-*`"
        return f"Weights & Biases: {self.run.url}"


class MLflowSink:
    def __init__(self, out_dir: Path, resume_step: int, settings):
        import mlflow

        self.mlflow = mlflow
        uri = settings.mlflow_tracking_uri or (out_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):  # MLflow 3 refuses its file store (in maintenance) unless asked for it
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(settings.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(settings.project)
        self.run_id = _run_id(out_dir / ".mlflow_run_id", lambda: self.client.create_run(
            experiment_id, run_name=settings.run_name or out_dir.name).info.run_id)
        self.where = uri

    def scalars(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def text(self, tag: str, step: int, text: str) -> None:
        self.client.log_text(self.run_id, text, f"{tag}/step_{step:06d}.md")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)

    def describe(self) -> str:
        return f"MLflow: run {self.run_id} in {self.where} (mlflow ui --backend-store-uri {self.where})"


SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "mlflow": MLflowSink}


def open_sinks(out_dir: str | os.PathLike, resume_step: int, settings) -> list:
    """One sink per tracker of `settings.trackers`, in that order."""
    return [SINKS[name](Path(out_dir), resume_step, settings) for name in settings.trackers]
