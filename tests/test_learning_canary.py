"""The learning canary: GRPO through the real runtime must raise the reward.

Every piece of the GRPO step has its own tests; this one checks what the pieces are for.  A tiny
model taught to answer "What is a plus b?" (a + b = 7 for every question) with 5 or 7 in the right
format, half and half, is trained for a few steps through `launch/train.sh` -> the `deepspeed`
launcher -> two ranks on gloo: rank 0 the policy pipeline, rank 1 the sampler (HF engine, which gets
the policy's weights after every step), reference and evaluator.  The reward is the built-in R1-Zero
grader (right format and answer 7).  The rollouts are on-policy, so the sampled reward only rises when
the advantages point the right way, the optimizer applies its learning rate to the right tokens'
log-probs, and the sampler receives the new weights.

What breaks it (each checked once by hand, with the numbers): the advantage's sign flipped (the
reward falls 0.42 -> 0), the weight sync skipped or the learning rate forced to zero (it stays at
0.42 -> 0.46).  With the fixed seed the run is deterministic: the same rewards, step by step, on
every run.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "launch" / "configs" / "grpo_cpu_tiny.yaml"

QUESTIONS = [f"What is {a} plus {7 - a}?" for a in range(8)]
STEPS = 10
# The reward of step 1 (the starting weights, 64 responses) against the mean of the last 3 steps.
# With the learning rate forced to 0 the per-step reward has a std of 0.048 over the 10 steps
# (64 draws at p ~ 0.44); the run climbs from 0.42 to 0.92 within a few steps, so a rise of 0.25
# is five of those stds and half the rise seen.
MIN_RISE = 0.25
OVERRIDES = (
    # Two ranks: the policy alone on rank 0, the sampler on its own rank 1, so every step's
    # weights travel to it through the real sync.
    "topology.policy_ranks=[0]", "topology.pipeline_stages=1", "topology.sampler_rank=1",
    "topology.reference_rank=1", "topology.evaluator_rank=1",
    "data.prompt_template=r1_short", "data.train_size=64", "data.eval_size=4",
    "sampling.backend=hf", "sampling.max_tokens=16", "sampling.temperature=1.0",
    "sampling.repetition_penalty=1.0",  # the answer repeats prompt tokens
    "reward.fn=rlft.reward.grader:r1_zero_reward_fn", "reward.format_weight=0",
    "grpo.loss_type=grpo_clip", "grpo.group_size=8", "grpo.kl_coef=0",
    "optim.rollout_batch_size=64", "optim.train_micro_batch_size=64", "optim.lr=1e-3",
    f"schedule.steps={STEPS}", "schedule.sync_every=1", "schedule.max_staleness=0",
    "schedule.evaluate_freq=0", "schedule.save_every=0", "seed=0",
)


def taught_sevens(root: Path) -> tuple[Path, Path]:
    """The model (taught on two of the questions, which is enough for all eight and a quarter of
    the cost of teaching every one) and the data: 8 copies of the 8 questions, all answered 7."""
    from conftest import teach_answer_format, write_gsm8k_dir
    from rlft.data.prompts import format_prompt
    from tiny_models import tiny_model_dir

    model = Path(tiny_model_dir(root / "model", family="llama", num_layers=4, tie_word_embeddings=True))
    teach_answer_format(model, [format_prompt(q, "r1_short") for q in QUESTIONS[:2]], ["5", "7"], steps=100)
    data = write_gsm8k_dir(root / "sevens", {"train": [(q, "7") for q in QUESTIONS] * 8,
                                             "test": [(q, "7") for q in QUESTIONS[:4]]})
    return model, data


def test_grpo_raises_the_reward(tmp_path):
    t0 = time.time()
    model, data = taught_sevens(tmp_path)
    taught = time.time() - t0
    out = tmp_path / "run"
    env = dict(os.environ, RLFT_PROGRESS="0")
    t0 = time.time()
    res = subprocess.run(["bash", str(REPO / "launch" / "train.sh"), str(CONFIG), f"model.path={model}",
                          f"data.source={data}", f"output.dir={out}", *OVERRIDES],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    took = time.time() - t0
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    rewards = [s["reward/mean"] for s in steps]
    start, end = rewards[0], sum(rewards[-3:]) / 3
    print(f"\nlearning canary: teaching {taught:.1f} s, launch and {len(steps)} steps {took:.1f} s | reward "
          f"{start:.3f} (step 1) -> {end:.3f} (last 3) | per step {[round(r, 3) for r in rewards]}")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    # The starting model answers 7 about half the time: the task is neither learnt nor out of reach,
    # and every step's groups mix rewards 0 and 1.
    assert 0.2 < start < 0.75, rewards
    assert end - start > MIN_RISE, f"the reward did not rise: {start:.3f} -> {end:.3f}, per step {rewards}"
