"""What a run reports: TensorBoard scalars and text, a JSONL line per step, concise log lines."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

log = logging.getLogger("rlft")


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
        parts.append(f"**reward {r['reward']:.0f} (format {r['format_reward']:.0f}), ground truth "
                     f"`{r['ground_truth']}`**\n\n> {question}\n\n{response}")
    return "\n\n---\n\n".join(parts)
