"""The teacher role (on-policy distillation, `distill.signal`): a stronger frozen model of the student's
tokenizer that scores every token of the student's own samples.

It is the reference role with another model: the same per-token log-probs (positions from the
attention mask, column t scores token t+1, one micro-batch at a time, under inference mode), on
`topology.teacher_rank` (by default the reference's rank; on one GPU beside the policy and the engine).
The student's token ids go to the teacher as they are, so the two tokenizers must give the same ids for
the same tokens, special tokens included: `tokenizer_difference` names the first that differs, and a
run with one is refused before the teacher is used (`rlft.config.distill_checks.tokenizer_difference`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlft.batching.batch import RolloutBatch
from rlft.common import log, resolve_dtype
from rlft.config.distill_checks import check_same_tokenizer
from rlft.grpo.distillation import distill_weight, sequence_correlation
from rlft.roles.reference import ReferenceModel

@dataclass
class TeacherScores:
    """What the teacher adds to a batch: its log-probs ``[B, T-1]`` and the step's weight per row ``[B]``."""

    logprobs: torch.Tensor
    weight: torch.Tensor


class Teacher(ReferenceModel):
    """The frozen teacher: per-token log-probs of a batch (`ReferenceModel.logprobs`), the step's
    distillation weight, and what the step logs of the teacher."""

    def __init__(self, model_path: str, distill, **kwargs):
        super().__init__(model_path, **kwargs)
        self.distill = distill
        self.last_metrics: dict[str, float] = {}
        vocab = getattr(self.model.config, "vocab_size", None) or self.model.get_output_embeddings().weight.shape[0]
        self.vocab_size = int(vocab)

    def score(self, batch: RolloutBatch, step: int) -> TeacherScores:
        """The teacher's log-probs of `batch` and the weight `distill.weight` has at `step`; the metrics
        (`last_metrics`): the teacher's mean log-prob per response token and its correlation, over the
        batch's sequences, with the reward."""
        if int(batch.input_ids.max()) >= self.vocab_size:
            raise ValueError(f"the batch holds token id {int(batch.input_ids.max())}, past the teacher's "
                             f"{self.vocab_size} embeddings")
        logprobs = self.logprobs(batch)
        mask = batch.response_mask.float()
        weight = distill_weight(self.distill.weight, self.distill.decay_steps, step)
        self.last_metrics = {"distill/weight": weight}
        if batch.raw_rewards is not None:
            self.last_metrics["distill/teacher_reward_corr"] = sequence_correlation(logprobs, mask, batch.raw_rewards)
        return TeacherScores(logprobs, torch.full((len(batch),), weight))


def build(ctx, training) -> Teacher:
    """The teacher on its rank (`topology.teacher_rank`): `teacher.path` resolved (a .gguf converted once),
    its tokenizer checked against the student's, loaded frozen in `teacher.dtype`."""
    from rlft.models.loading import load_tokenizer, resolve_model_path

    cfg = ctx.cfg
    path = resolve_model_path(cfg.teacher.path)
    check_same_tokenizer(ctx.tokenizer, load_tokenizer(path), cfg.teacher.path)
    teacher = Teacher(path, cfg.distill, dtype=resolve_dtype(cfg.teacher.dtype, ctx.device.type), device=ctx.device,
                      micro_batch_size=cfg.teacher.micro_batch_size or cfg.optim.train_micro_batch_size,
                      attn_implementation=cfg.model.attn_implementation)
    log.info("teacher: %s on rank %d (%s, distill.signal %s, weight %g%s)", cfg.teacher.path, ctx.roles.rank,
             teacher.model.dtype, cfg.distill.signal, cfg.distill.weight,
             f", decayed to 0 over {cfg.distill.decay_steps} steps" if cfg.distill.decay_steps else "")
    return teacher
