"""The checks of on-policy distillation's settings (`teacher:`, `distill:`), before any rank starts.

`check_distillation` (from `validate`): the signal is a registered one; a signal that reads a teacher has
`teacher.path`, and a teacher is loaded only for a signal that reads it; a loss that reads raw rewards
(no advantages) cannot take a per-token signal; ranges.  `check_same_tokenizer`: the same ids for the same
tokens in the student's and the teacher's tokenizers (the launch's preflight, where both are on disk, and
the teacher's rank).  `distill_warnings`: settings that run but waste the teacher's signal.
"""
from __future__ import annotations

from rlft.common import DTYPE_CHOICES
from rlft.config.schema import ConfigError, RunConfig
from rlft.grpo.choices import DISTILL_SIGNALS, POLICY_LOSSES


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_distillation(cfg: RunConfig) -> None:
    d, teacher = cfg.distill, cfg.teacher
    _require(d.signal in DISTILL_SIGNALS,
             f"distill.signal: must be one of {', '.join(DISTILL_SIGNALS)}, got {d.signal!r}")
    signal = DISTILL_SIGNALS[d.signal]
    _require(not signal.uses_teacher or bool(teacher.path),
             f"distill.signal: {d.signal} scores the student's samples with a teacher; set teacher.path "
             f"(a stronger model of the same tokenizer)")
    _require(signal.uses_teacher or not teacher.path,
             f"teacher.path: set, but distill.signal is {d.signal}, which reads no teacher: the teacher would be "
             f"loaded and never used; set distill.signal: {' or '.join(n for n, r in DISTILL_SIGNALS.items() if r.uses_teacher)}")
    _require(d.weight > 0, f"distill.weight: must be > 0, got {d.weight}")
    _require(d.clip is None or d.clip > 0, f"distill.clip: must be > 0 or null, got {d.clip}")
    _require(d.decay_steps >= 0, f"distill.decay_steps: must be >= 0 (0 = a constant weight), got {d.decay_steps}")
    _require(teacher.dtype in DTYPE_CHOICES,
             f"teacher.dtype: must be one of {', '.join(DTYPE_CHOICES)}, got {teacher.dtype!r}")
    _require(teacher.micro_batch_size is None or teacher.micro_batch_size >= 1,
             f"teacher.micro_batch_size: must be >= 1 or null, got {teacher.micro_batch_size}")
    if signal.uses_teacher:
        _require(POLICY_LOSSES[cfg.grpo.loss_type].uses_groups,
                 f"grpo.loss_type: {cfg.grpo.loss_type} weighs raw rewards, not advantages, so distill.signal "
                 f"{d.signal} has nothing to add its per-token term to; use grpo_clip or reinforce_with_baseline")


def distill_warnings(cfg: RunConfig) -> list[str]:
    """Valid settings that waste the teacher's signal, one sentence each."""
    signal = DISTILL_SIGNALS.get(cfg.distill.signal)
    if signal is None or not signal.uses_teacher:
        return []
    found = []
    if cfg.grpo.dynamic_sampling and not signal.uses_rewards:
        found.append(f"grpo.dynamic_sampling is on with distill.signal {cfg.distill.signal}, whose advantages do not "
                     f"read the rewards: it discards the groups whose rewards are equal, which the teacher's "
                     f"per-token signal would train on; set grpo.dynamic_sampling: false")
    return found


SPECIAL_TOKEN_IDS = ("eos_token_id", "bos_token_id", "pad_token_id")


def tokenizer_difference(student, teacher) -> str | None:
    """The first way the teacher's tokenizer gives other ids than the student's (None: none): a token of
    either vocabulary (added and special tokens included) with another id or missing from the other, or
    an end-of-sequence, beginning or padding token that differs."""
    sv, tv = student.get_vocab(), teacher.get_vocab()
    for token, i in sorted(sv.items(), key=lambda kv: kv[1]):
        j = tv.get(token)
        if j != i:
            return (f"token {token!r} is id {i} for the student and "
                    f"{'not in the teacher vocabulary' if j is None else f'id {j} for the teacher'}")
    for token, j in sorted(tv.items(), key=lambda kv: kv[1]):
        if token not in sv:
            return f"token {token!r} (teacher id {j}) is not in the student's vocabulary"
    for name in SPECIAL_TOKEN_IDS:
        a, b = getattr(student, name, None), getattr(teacher, name, None)
        if a is not None and b is not None and a != b:
            return f"{name} is {a} for the student and {b} for the teacher"
    return None


def check_same_tokenizer(student, teacher, teacher_path: str) -> None:
    """ConfigError (one line) when the teacher's tokenizer differs from the student's."""
    diff = tokenizer_difference(student, teacher)
    if diff is not None:
        raise ConfigError(f"teacher.path: {teacher_path} has another tokenizer than the student ({diff}); "
                          f"distillation scores the student's token ids with the teacher, so both must share one")
