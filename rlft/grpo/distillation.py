"""On-policy distillation: per-token advantages from a teacher's log-probs of the student's own samples.

The student samples, the teacher scores every token of those samples, and the per-token reverse KL
estimate ``log π_student(y_t) − log π_teacher(y_t)`` is the cost of token t (Agarwal et al. 2024, GKD;
Thinking Machines' on-policy distillation).  Its negative is a dense, per-token advantage: the policy
gradient raises the tokens the teacher finds likelier than the student does and lowers the others.
Both log-probs are detached: the teacher's are a label, and the student's are those of the weights
that sampled (the ratio's π_old), so the signal is an advantage, not a loss to differentiate.

Each signal is a record of :data:`rlft.grpo.choices.DISTILL_SIGNALS` (``distill.signal``); its
function here, attached with ``@DISTILL_FUNCTIONS.of(name)``, returns the ``[B, T]`` advantages:

* ``none``      the group advantage alone (``[B, 1]``, as without a teacher)
* ``opd``       w · (log π_teacher − log π_student), per token
* ``grpo_opd``  A_group + w · (log π_teacher − log π_student)

``w`` is ``distill.weight``, decayed linearly to 0 over ``distill.decay_steps`` (:func:`distill_weight`).
The term is clamped to ``[-distill.clip, distill.clip]``: where the teacher gives a sampled token almost
no probability the single-sample estimate runs to −20 and more, and one such token would outweigh the
rest of the batch (a tiny student taught 5 or 7, its teacher 7 alone, collapsed in one step unclamped).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from rlft.grpo.choices import DISTILL_SIGNALS, DistillSignal, Implementations
from rlft.grpo.reductions import masked_mean

# (group advantages [B, 1], the OPD term [B, T] (rlft's own signals add it, weighted), weight [B, 1]) -> [B, T] or [B, 1]
DistillFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

DISTILL_FUNCTIONS = Implementations(DISTILL_SIGNALS, "distillation signal")

# The per-micro-batch metrics the GRPO objective logs when a teacher scores the batch.
DISTILL_METRIC_KEYS = ("distill/reverse_kl", "distill/teacher_logprob", "distill/opd_advantage")


def register_distill_signal(name: str, *, uses_teacher: bool, uses_rewards: bool) -> Callable[[DistillFn], DistillFn]:
    """Decorator adding a signal that is not one of rlft's own to :data:`DISTILL_SIGNALS` under ``name``."""
    return DISTILL_FUNCTIONS.register(DistillSignal(name, uses_teacher, uses_rewards))


def opd_term(student: Tensor, teacher: Tensor, clip: float | None = None, mask: Tensor | None = None) -> Tensor:
    """``[B, T]`` per-token OPD advantage before weighting: log π_teacher − log π_student (detached),
    clamped to ``[-clip, clip]`` when ``clip`` is set, less its mean over the response tokens of ``mask``
    when one is given (a baseline)."""
    term = (teacher - student).detach()
    term = term if clip is None else term.clamp(-clip, clip)
    return term if mask is None else term - masked_mean(term, mask)


@DISTILL_FUNCTIONS.of("none")
def _rewards_alone(advantages: Tensor, opd: Tensor, weight: Tensor) -> Tensor:
    return advantages


@DISTILL_FUNCTIONS.of("opd")
def _on_policy_distillation(advantages: Tensor, opd: Tensor, weight: Tensor) -> Tensor:
    return weight * opd


@DISTILL_FUNCTIONS.of("grpo_opd")
def _rewards_and_distillation(advantages: Tensor, opd: Tensor, weight: Tensor) -> Tensor:
    return advantages + weight * opd


def token_advantages(signal: str, advantages: Tensor, student: Tensor, teacher: Tensor | None,
                     weight: Tensor | None, clip: float | None = None, mask: Tensor | None = None) -> Tensor:
    """The advantages ``signal`` gives: ``advantages`` ``[B]``/``[B, 1]`` per sequence, ``student`` and
    ``teacher`` ``[B, T]`` log-probs of the sampled tokens, ``weight`` ``[B]``/``[B, 1]`` (the step's
    ``distill.weight``), ``clip`` the OPD term's bound (``distill.clip``).  ``[B, T]`` for a signal that
    reads the teacher, else ``[B, 1]``."""
    advantages = advantages.reshape(-1, 1)
    if not DISTILL_SIGNALS[signal].uses_teacher:
        return DISTILL_FUNCTIONS[signal](advantages, torch.zeros_like(student), advantages.new_zeros(advantages.shape))
    if teacher is None or teacher.shape != student.shape:
        raise ValueError(f"distill.signal {signal}: the teacher's log-probs must be [B, T] like the student's "
                         f"{tuple(student.shape)}, got {None if teacher is None else tuple(teacher.shape)}")
    weight = advantages.new_ones(advantages.shape) if weight is None else weight.reshape(-1, 1)
    return DISTILL_FUNCTIONS[signal](advantages, opd_term(student, teacher, clip, mask), weight)


def distill_weight(weight: float, decay_steps: int, step: int) -> float:
    """``distill.weight`` at ``step`` (1-based): constant, or falling linearly from ``weight`` at step 1
    to 0 at step ``decay_steps + 1`` and after."""
    if decay_steps <= 0:
        return float(weight)
    return float(weight) * max(0.0, 1.0 - (step - 1) / decay_steps)


def distill_metrics(student: Tensor, teacher: Tensor, mask: Tensor, weight: Tensor | None,
                    clip: float | None = None) -> dict[str, Tensor]:
    """One micro-batch's distillation metrics (means over its response tokens): the per-token reverse KL
    estimate log π_student − log π_teacher, the teacher's log-prob of the sampled tokens, and the OPD
    term as clamped and weighted into the advantage."""
    with torch.no_grad():
        student, teacher, mask = student.detach().float(), teacher.detach().float(), mask.float()
        w = 1.0 if weight is None else weight.reshape(-1, 1).float()
        return {"distill/reverse_kl": masked_mean(student - teacher, mask),
                "distill/teacher_logprob": masked_mean(teacher, mask),
                "distill/opd_advantage": masked_mean(w * opd_term(student, teacher, clip), mask)}



def sequence_correlation(teacher: Tensor, mask: Tensor, rewards: Tensor) -> float:
    """Pearson correlation, over a batch's sequences, of the teacher's mean log-prob of each response
    with its reward (0 when either does not vary): does the teacher prefer the right answers?"""
    per_seq = (teacher.float() * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    x, y = per_seq - per_seq.mean(), rewards.float().reshape(-1) - rewards.float().mean()
    denom = float(x.norm() * y.norm())
    return float((x * y).sum()) / denom if denom > 0 else 0.0
