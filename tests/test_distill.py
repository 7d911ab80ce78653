"""On-policy distillation: the per-token advantages against hand-computed values, the teacher's log-probs
against the plain HF model's, the settings refused before any rank starts (a tokenizer mismatch among
them), and a tiny student that learns faster from a teacher taught the answers than from GRPO alone."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import layered

from rlft.batching.batch import Labels, RolloutBatch
from rlft.config import ConfigError, build_config, config_warnings
from rlft.grpo.distillation import distill_weight, sequence_correlation, token_advantages

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "launch" / "configs" / "grpo_cpu_tiny.yaml"

STUDENT = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.0]])
TEACHER = torch.tensor([[-0.5, -2.5, -0.5], [-2.1, -1.0, -0.2]])
GROUP_ADVANTAGES = torch.tensor([1.0, -1.0])


def test_opd_advantage_is_teacher_minus_student_per_token():
    got = token_advantages("opd", GROUP_ADVANTAGES, STUDENT, TEACHER, torch.tensor([2.0, 2.0]))
    # 2 x (teacher - student), token by token; the group advantage plays no part.
    assert torch.allclose(got, torch.tensor([[1.0, -1.0, 0.0], [-4.0, 4.0, 1.6]]))


def test_grpo_opd_adds_the_weighted_term_to_the_group_advantage():
    got = token_advantages("grpo_opd", GROUP_ADVANTAGES, STUDENT, TEACHER, torch.tensor([0.5, 0.5]))
    assert torch.allclose(got, torch.tensor([[1.25, 0.75, 1.0], [-2.0, 0.0, -0.6]]))


def test_the_term_is_clamped_and_optionally_baselined():
    # teacher - student = [[0.5, -0.5, 0], [-2, 2, 0.8]]; clamped to +-1: [[0.5, -0.5, 0], [-1, 1, 0.8]].
    clamped = torch.tensor([[0.5, -0.5, 0.0], [-1.0, 1.0, 0.8]])
    got = token_advantages("opd", GROUP_ADVANTAGES, STUDENT, TEACHER, None, clip=1.0)
    assert torch.allclose(got, clamped)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    mean = (clamped * mask).sum() / 5  # 0.16 over the five response tokens
    got = token_advantages("opd", GROUP_ADVANTAGES, STUDENT, TEACHER, None, clip=1.0, mask=mask)
    assert torch.allclose(got, clamped - mean)


def test_no_signal_is_the_group_advantage_alone():
    got = token_advantages("none", GROUP_ADVANTAGES, STUDENT, None, None)
    assert got.shape == (2, 1) and torch.equal(got[:, 0], GROUP_ADVANTAGES)


def test_a_teacher_of_another_shape_is_refused():
    with pytest.raises(ValueError, match="teacher's log-probs must be"):
        token_advantages("opd", GROUP_ADVANTAGES, STUDENT, TEACHER[:, :2], None)


def test_weight_decays_linearly_to_zero():
    assert [distill_weight(2.0, 4, s) for s in (1, 2, 3, 5, 9)] == [2.0, 1.5, 1.0, 0.0, 0.0]
    assert distill_weight(0.7, 0, 100) == 0.7


def test_teacher_reward_correlation():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    teacher = torch.tensor([[-1.0, -3.0, -50.0], [-1.0, -1.0, -1.0], [-4.0, 0.0, 0.0]])
    # Per-sequence means -2, -1, -4 against rewards 0, 1, 0: Pearson's r by hand.
    x, y = [-2.0, -1.0, -4.0], [0.0, 1.0, 0.0]
    mx, my = sum(x) / 3, sum(y) / 3
    r = sum((a - mx) * (b - my) for a, b in zip(x, y)) / math.sqrt(
        sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))
    assert sequence_correlation(teacher, mask, torch.tensor([0.0, 1.0, 0.0])) == pytest.approx(r)
    assert sequence_correlation(teacher, mask, torch.ones(3)) == 0.0


def test_the_objective_weighs_each_token_by_its_distilled_advantage():
    """reinforce_with_baseline, token aggregation: loss = -sum_t A_t logp_t / tokens, with A_t the group
    advantage + w (teacher - student) and the student's log-probs those that are trained (one epoch)."""
    from rlft.objectives import GRPOObjective

    cfg = build_config({}, ["grpo.loss_type=reinforce_with_baseline", "grpo.aggregation=token",
                            "distill.signal=grpo_opd", "teacher.path=/nowhere", "grpo.group_size=2"])
    objective = GRPOObjective(cfg.grpo, 8, distill=cfg.distill)
    assert "teacher_logprobs" in objective.label_fields and objective.needs_teacher
    logp = STUDENT.clone().requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    labels = Labels(response_mask=mask, advantages=GROUP_ADVANTAGES, raw_rewards=torch.tensor([1.0, 0.0]),
                    teacher_logprobs=TEACHER, distill_weight=torch.tensor([0.5, 0.5]))
    loss, metrics = objective.loss(logp, torch.zeros_like(logp), labels, num_tokens_total=5.0, num_micro_batches=1)
    adv = torch.tensor([[1.25, 0.75, 1.0], [-2.0, 0.0, -0.6]])
    expected = -(adv * STUDENT * mask).sum() / 5
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, -adv * mask / 5)
    # Reverse KL = mean over the 5 response tokens of student - teacher.
    assert metrics["distill/reverse_kl"].item() == pytest.approx(((STUDENT - TEACHER) * mask).sum().item() / 5)
    assert metrics["distill/teacher_logprob"].item() == pytest.approx((TEACHER * mask).sum().item() / 5)


@pytest.mark.parametrize("overrides, message", [
    (["distill.signal=opd"], "set teacher.path"),
    (["teacher.path=/x"], "never used"),
    (["distill.signal=grpo_opd", "teacher.path=/x", "distill.weight=0"], "distill.weight: must be > 0"),
    (["distill.signal=grpo_opd", "teacher.path=/x", "distill.decay_steps=-1"], "distill.decay_steps"),
    (["distill.signal=kd", "teacher.path=/x"], "distill.signal: must be one of none, opd, grpo_opd"),
    (["distill.signal=opd", "teacher.path=/x", "grpo.loss_type=no_baseline", "grpo.group_size=1"],
     "weighs raw rewards"),
    (["distill.signal=opd", "teacher.path=/x", "teacher.dtype=fp8"], "teacher.dtype"),
    (["distill.signal=opd", "teacher.path=/x", "distill.clip=0"], "distill.clip"),
])
def test_settings_that_cannot_distil_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config({}, overrides)


def test_the_teacher_sits_on_the_reference_rank_unless_placed():
    cfg = build_config({}, ["distill.signal=opd", "teacher.path=/x", "topology.reference_rank=6"])
    assert cfg.topology.teacher_rank == 6
    assert build_config({}, []).topology.teacher_rank is None  # no teacher: no rank hosts one
    cfg = build_config({}, ["distill.signal=opd", "teacher.path=/x", "grpo.dynamic_sampling=true"])
    assert any("discards the groups" in w for w in config_warnings(cfg))


def _batch(tok, texts: list[str], prompt_len: int) -> RolloutBatch:
    from rlft.batching.batch import tokenize_prompt_and_output

    return tokenize_prompt_and_output([t[:prompt_len] for t in texts], [t[prompt_len:] for t in texts], tok)


def test_teacher_logprobs_equal_the_plain_hf_models(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlft.roles.teacher import Teacher
    from tiny_models import tiny_model_dir

    path = tiny_model_dir(tmp_path / "teacher", family="qwen2", num_layers=2, seed=3)
    tok = AutoTokenizer.from_pretrained(path)
    batch = _batch(tok, ["What is 2 plus 5? It is 7.", "Hi. 12 + 30 = 42, so 42."], 8)
    cfg = build_config({}, ["distill.signal=opd", f"teacher.path={path}", "distill.weight=0.5",
                            "distill.decay_steps=2"])
    teacher = Teacher(path, cfg.distill, dtype="float32", device=torch.device("cpu"), micro_batch_size=1)
    batch.raw_rewards = torch.tensor([1.0, 0.0])
    scores = teacher.score(batch, step=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for row in range(len(batch)):  # each sequence alone, unpadded
        n = int(batch.attention_mask[row].sum())
        ids = batch.input_ids[row, :n][None]
        want = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        assert torch.allclose(scores.logprobs[row, :n - 1], want, atol=1e-5)
    assert scores.weight.tolist() == [0.25, 0.25]
    assert set(teacher.last_metrics) == {"distill/weight", "distill/teacher_reward_corr"}


def test_a_teacher_with_another_tokenizer_is_named_and_refused(tmp_path):
    from transformers import AutoTokenizer

    from rlft.config.distill_checks import tokenizer_difference
    from tiny_models import tiny_model_dir

    a = tiny_model_dir(tmp_path / "a", num_layers=2)
    b = tiny_model_dir(tmp_path / "b", num_layers=1, seed=5)  # same tokenizer, other weights
    c = tiny_model_dir(tmp_path / "c", num_layers=1, vocab_size=300)  # a smaller vocabulary
    ta, tb, tc = (AutoTokenizer.from_pretrained(p) for p in (a, b, c))
    assert tokenizer_difference(ta, tb) is None
    diff = tokenizer_difference(ta, tc)
    assert diff is not None and "for the student and" in diff
    # Through the launch: refused before any rank starts, one line, exit status 2.
    res = subprocess.run(["bash", str(REPO / "launch" / "train.sh"), str(CONFIG), f"model.path={a}",
                          f"teacher.path={c}", "distill.signal=opd", f"output.dir={tmp_path / 'out'}"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-3000:]
    assert "teacher.path:" in res.stderr and "another tokenizer than the student" in res.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ through launch/train.sh

QUESTIONS = [f"What is {a} plus {7 - a}?" for a in range(8)]
STEPS = 6
ARM_OVERRIDES = (
    "topology.policy_ranks=[0]", "topology.pipeline_stages=1", "topology.sampler_rank=1",
    "topology.reference_rank=1", "topology.evaluator_rank=1",
    "data.prompt_template=r1_short", "data.train_size=64", "data.eval_size=4",
    "sampling.backend=hf", "sampling.max_tokens=16", "sampling.temperature=1.0", "sampling.repetition_penalty=1.0",
    "reward.fn=rlft.reward.grader:r1_zero_reward_fn", "reward.format_weight=0",
    "grpo.loss_type=grpo_clip", "grpo.group_size=8", "grpo.kl_coef=0", "grpo.aggregation=token",
    "optim.rollout_batch_size=64", "optim.train_micro_batch_size=64", "optim.lr=5e-4",
    f"schedule.steps={STEPS}", "schedule.evaluate_freq=0", "schedule.save_every=0", "seed=0",
)


@pytest.fixture(scope="module")
def student_and_teacher(tmp_path_factory):
    """A student answering 5 or 7 half and half (7 is right for every question) and a teacher of the same
    tokenizer taught to answer 7; the 8 questions 8 times over.  (A teacher that has never seen the student's
    wrong answer scores what follows it as unlikely too: with a student answering 5 three times in four,
    such a teacher's signal broke the answer format in one step.)"""
    from conftest import teach_answer_format, write_gsm8k_dir
    from rlft.data.prompts import format_prompt
    from tiny_models import tiny_model_dir

    root = tmp_path_factory.mktemp("distill")
    prompts = [format_prompt(q, "r1_short") for q in QUESTIONS[:2]]
    student = tiny_model_dir(root / "student", num_layers=4, tie_word_embeddings=True)
    teach_answer_format(student, prompts, ["5", "7"], steps=100)
    teacher = tiny_model_dir(root / "teacher", num_layers=4, tie_word_embeddings=True)
    teach_answer_format(teacher, prompts, ["7"], steps=100)
    data = write_gsm8k_dir(root / "sevens", {"train": [(q, "7") for q in QUESTIONS] * 8,
                                             "test": [(q, "7") for q in QUESTIONS[:4]]})
    return Path(student), Path(teacher), data


def _launch(out: Path, student: Path, data: Path, *overrides: str) -> list[dict]:
    res = subprocess.run(["bash", str(REPO / "launch" / "train.sh"), str(CONFIG), f"model.path={student}",
                          f"data.source={data}", f"output.dir={out}", *layered(*ARM_OVERRIDES, *overrides)],
                         cwd=REPO, env=dict(os.environ, RLFT_PROGRESS="0"), capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


OPD = ("distill.signal=opd", "grpo.dynamic_sampling=false")


@pytest.fixture(scope="module")
def opd_run(student_and_teacher, tmp_path_factory):
    """The distilling launch on two ranks (policy; sampler + reference + teacher), STEPS steps, its last
    checkpoint saved at the end: (output directory, its steps)."""
    student, teacher, data = student_and_teacher
    out = tmp_path_factory.mktemp("opd") / "run"
    return out, _launch(out, student, data, f"teacher.path={teacher}", *OPD)


def test_the_teachers_signal_alone_teaches_the_student(opd_run):
    """Two ranks (policy; sampler + reference + teacher), distill.signal opd: the advantages hold no reward
    at all, only the teacher's log-probs against the student's, yet the reward of the student's own samples
    rises (0.42 -> 0.72 with this seed) and the per-token reverse KL to the teacher falls (0.55 -> 0.15).
    The teacher's sign flipped, the reward would fall instead.  (Against GRPO alone on this task the same
    launch rises as fast, not faster: one token decides the reward, which GRPO's advantage already reaches.)"""
    _, steps = opd_run
    rewards, kl = [s["reward/mean"] for s in steps], [s["distill/reverse_kl"] for s in steps]
    print(f"\nopd: reward per step {[round(r, 3) for r in rewards]} | reverse KL {[round(k, 3) for k in kl]}")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert sum(rewards[-3:]) / 3 - rewards[0] > 0.2, rewards
    assert kl[0] > 0.3 and sum(kl[-2:]) / 2 < kl[0] / 2, kl
    assert "time/teacher" in steps[0] and steps[0]["distill/weight"] == 1.0


def test_one_process_hosts_the_teacher_and_resumes(student_and_teacher, opd_run, tmp_path):
    """Every role on one rank (as on one GPU), the teacher's too: a launch resumes the two-rank run above
    from its last checkpoint (the policy's layout, one stage, is the same; where the other roles sit may
    change) and goes on distilling."""
    student, teacher, data = student_and_teacher
    first_dir, first = opd_run
    shutil.copytree(first_dir, tmp_path / "run")
    one_rank = ("topology.sampler_rank=0", "topology.reference_rank=0", "topology.evaluator_rank=0",
                f"teacher.path={teacher}", *OPD)
    both = _launch(tmp_path / "run", student, data, *one_rank, f"schedule.steps={STEPS + 1}")
    assert [s["step"] for s in both] == list(range(1, STEPS + 2)) and both[:STEPS] == first
    assert both[STEPS]["distill/weight"] == 1.0 and "distill/teacher_logprob" in both[STEPS]
