"""The config's sections of on-policy distillation, `teacher:` and `distill:` (their checks:
`rlft.config.distill_checks`; the maths: `rlft.grpo.distillation`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TeacherConfig:
    # On-policy distillation (distill.signal): a stronger model of the student's tokenizer scores every
    # token of the student's own samples.  null = no teacher.  A hub id, a local directory or a .gguf file.
    path: str | None = None
    dtype: str = "auto"  # auto = bf16 on GPU, fp32 on CPU
    micro_batch_size: int | None = None  # sequences per teacher forward pass (null = optim.train_micro_batch_size)


@dataclass
class DistillConfig:
    # The per-token advantage the policy gradient weighs each response token by (rlft/grpo/distillation.py):
    # none (the group-normalised reward alone) | opd (on-policy distillation: the teacher's log-prob of the
    # token minus the student's, a per-token reverse KL) | grpo_opd (the group advantage + weight x opd's)
    signal: str = "none"
    weight: float = 1.0  # the OPD term's weight (grpo_opd; opd scales its one term by it)
    decay_steps: int = 0  # > 0: the weight falls linearly to 0 over this many steps (0 = constant)
    # The OPD term of a token is clamped to [-clip, clip] nats (null = unbounded): a token the teacher finds
    # all but impossible would otherwise outweigh the rest of the batch.
    clip: float | None = 5.0
    # Subtract the OPD term's mean over a micro-batch's response tokens (a baseline): the per-token reverse
    # KL is positive on average, so unbaselined the signal mostly pushes the sampled tokens down.
    baseline: bool = False
