"""What a run reports: TensorBoard scalars and text, a JSONL line per step, concise log lines.

Every rank's step metrics are gathered on rank 0, which merges them (`merge_metrics`) and writes
them (`rlft.runtime.loop.report`)."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path


def setup_logging(rank: int, roles: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank} {roles}] %(message)s",
                        datefmt="%H:%M:%S", force=True)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "httpx", "vllm"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class Tracker:
    """Lives on the coordinating rank only: every other rank sends it their metrics."""

    def __init__(self, out_dir: str | Path, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(out_dir)
        self.tb_dir = self.dir / "tensorboard"
        self.writer = SummaryWriter(str(self.tb_dir), purge_step=purge_step)
        self.steps_file = open(self.dir / "steps.jsonl", "a")

    def scalars(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in sorted(metrics.items()):
            if isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def text(self, tag: str, step: int, text: str) -> None:
        self.writer.add_text(tag, text, step)

    def record(self, step: int, record: dict) -> None:
        self.steps_file.write(json.dumps({"step": step, "time": time.time(), **record}) + "\n")
        self.steps_file.flush()

    def close(self) -> None:
        self.writer.close()
        self.steps_file.close()


def format_samples(rows: list[dict]) -> str:
    """Markdown for TensorBoard's text tab: reward, ground truth, question and the completion."""
    parts = []
    for r in rows:
        question = " ".join(r["question"].split())
        response = "    " + ("<think>" + r["response"]).replace("\n", "\n    ")  # a code block keeps it verbatim
        parts.append(f"**reward {r['reward']:g} (format {r['format_reward']:g}), ground truth "
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
