"""What a run reports: scalars and text to its trackers (TensorBoard, W&B, MLflow:
`rlft.runtime.trackers`), a JSONL line per step, concise log lines.

Every rank's step metrics are gathered on rank 0, which merges them (`merge_metrics`) and writes
them (`rlft.runtime.loop.report`)."""
from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path


def setup_logging(rank: int, roles: str) -> None:
    """A rank's log lines name the rank and its roles; the libraries' own (DeepSpeed's, the engines',
    as their records list them) are kept to warnings."""
    from rlft.engines import BACKENDS

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank} {roles}] %(message)s",
                        datefmt="%H:%M:%S", force=True)
    engines = [name for record in BACKENDS.values() for name in record.loggers]
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "httpx", *engines):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class Tracker:
    """Lives on the coordinating rank only: every other rank sends it their metrics.

    A run that continues from the checkpoint of step `resume_step` (0 = a fresh start) keeps the
    records of the steps up to it only: TensorBoard purges the later ones and steps.jsonl is cut
    to them, so the steps that are run again are not recorded twice.  steps.jsonl holds one valid
    JSON object per line and one line per step: a non-finite number is written as null, and a
    second record of the last step is merged into its line."""

    def __init__(self, out_dir: str | Path, resume_step: int = 0, settings=None):
        from rlft.config.schema import ReportingConfig
        from rlft.runtime.trackers import open_sinks

        self.dir = Path(out_dir)
        self.tb_dir = self.dir / "tensorboard"
        self.sinks = open_sinks(self.dir, resume_step, settings or ReportingConfig())
        self.steps_path = self.dir / "steps.jsonl"
        kept = [r for r in read_records(self.steps_path) if resume_step and r.get("step", 0) <= resume_step]
        tmp = self.steps_path.with_name(self.steps_path.name + ".tmp")
        tmp.write_text("".join(_json_line(r) for r in kept))
        os.replace(tmp, self.steps_path)
        self.steps_file = open(self.steps_path, "a")
        self._last = kept[-1] if kept else None  # the last line's record, which a record of its step merges into
        self._last_offset = self.steps_path.stat().st_size - (len(_json_line(self._last)) if kept else 0)

    def scalars(self, step: int, metrics: dict[str, float]) -> None:
        """The numbers of `metrics` (other values left out), to every tracker alike."""
        numbers = {k: v for k, v in sorted(metrics.items()) if isinstance(v, (int, float))}
        for sink in self.sinks:
            sink.scalars(step, numbers)

    def text(self, tag: str, step: int, text: str) -> None:
        for sink in self.sinks:
            sink.text(tag, step, text)

    def describe(self) -> list[str]:
        """Where each tracker writes, one line each."""
        return [sink.describe() for sink in self.sinks]

    def record(self, step: int, record: dict) -> None:
        """One line of steps.jsonl; a second record of the last line's step is merged into that line."""
        if self._last is not None and self._last.get("step") == step:
            self.steps_file.truncate(self._last_offset)
            self.steps_file.seek(self._last_offset)
            record = {**self._last, **record}
        else:
            self._last_offset = self.steps_file.tell()
        self._last = {"step": step, "time": time.time(), **{k: v for k, v in record.items() if k != "step"}}
        self.steps_file.write(_json_line(self._last))
        self.steps_file.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.steps_file.close()


def read_records(path: str | Path) -> list[dict]:
    """steps.jsonl's records (none when the file is missing; a line that does not parse is dropped)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def finite_or_none(value):
    """`value` with every non-finite float (NaN, inf) replaced by None, inside lists and dicts too."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def _json_line(record: dict) -> str:
    return json.dumps(finite_or_none(record), allow_nan=False) + "\n"


def format_samples(rows: list[dict]) -> str:
    """Markdown for TensorBoard's text tab: reward, ground truth, question and the completion (an
    episode's whole transcript, tool replies and the template's markers included)."""
    parts = []
    for r in rows:
        question = " ".join(r["question"].split())
        if "transcript" in r:
            text = r["transcript"]
            episode = (f", {r['turns']} turns, {r['tool_calls']} tool calls ({r['tool_errors']} errors), "
                       f"ended: {r['finish_reason']}")
        else:
            text, episode = "<think>" + r["response"], ""
        response = "    " + text.replace("\n", "\n    ")  # a code block keeps it verbatim
        parts.append(f"**reward {r['reward']:g} (format {r['format_reward']:g}){episode}, ground truth "
                     f"`{r['ground_truth']}`**\n\n> {question}\n\n{response}")
    return "\n\n---\n\n".join(parts)


def merge_metrics(gathered: list[dict]) -> tuple[dict, list[dict] | None]:
    """Every rank's step metrics -> one record (the slowest rank's time per phase, the largest peak
    memory and each rank's, the stages' checksum parts summed, throughputs) and the logged sample
    completions."""
    merged: dict = {}
    seconds: dict = {}
    peak = 0.0
    samples = None
    for rank, m in enumerate(gathered):  # in rank order (extra metrics, if any, come last)
        for k, v in m.items():
            if k == "seconds":
                for phase, s in v.items():
                    seconds[phase] = max(seconds.get(phase, 0.0), s)
            elif k == "phase_memory_gb":  # GPU: each phase's peak allocated memory, the largest rank's
                for phase, gb in v.items():
                    merged[f"memory/peak_gb/{phase}"] = max(merged.get(f"memory/peak_gb/{phase}", 0.0), gb)
            elif k == "peak_memory_gb":
                peak = max(peak, v)
                merged[f"memory/peak_gb/rank{rank}"] = v  # per rank, so each role's share can be read
            elif k == "samples":
                samples = v
            elif k != "epoch_ended":
                merged[k] = v
    for kind in ("sum", "abs_sum"):  # stages report their parts of the synced weights' checksum
        parts = [v for k, v in merged.items() if k.startswith(f"sync/policy_{kind}/")]
        if parts:
            merged[f"sync/policy_{kind}"] = sum(parts)
            for k in [k for k in merged if k.startswith(f"sync/policy_{kind}/")]:
                del merged[k]
    stage_sums = [k for k in merged if k.startswith("time/sync/checksum_policy/")]
    if stage_sums:  # the slowest stage's own checksum
        merged["time/sync/checksum_policy"] = max(merged.pop(k) for k in stage_sums)
    merged.update({f"time/{k}": v for k, v in seconds.items()})
    merged["memory/peak_gb"] = peak
    if "tokens/total" in merged and seconds.get("step"):
        merged["throughput/tokens_per_s"] = merged["tokens/total"] / seconds["step"]
    if "tokens/response" in merged and seconds.get("sample"):
        merged["throughput/sample_tokens_per_s"] = merged["tokens/response"] / seconds["sample"]
    return merged, samples


def progress_line(step: int, merged: dict) -> str:
    """The step's headline numbers in one line."""
    parts = [f"step {step}"]
    for key, label in (("reward/mean", "reward"), ("reward/format", "format"), ("loss", "loss"),
                       ("kl", "kl"), ("grad_norm", "gnorm"), ("eval/accuracy", "eval_acc"),
                       ("time/step", "s/step")):
        if key in merged:
            parts.append(f"{label} {merged[key]:.4g}")
    return " | ".join(parts)
