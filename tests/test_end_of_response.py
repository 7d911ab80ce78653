"""The token that ends a response is trained (`grpo.train_on_eos`, default true): the policy can learn
when to stop, padding stays out whatever its id, and `false` gives back the original's mask."""
from types import SimpleNamespace

import pytest
import torch

from rlft.config import build_config
from rlft.grpo.losses import compute_policy_gradient_loss
from rlft.grpo.reductions import aggregate_loss
from conftest import rollout_rows
from rlft.roles.rollout import RolloutWorker

EOS = 2  # also the pad id here, as with tokenizers that pad with eos


def worker(**grpo) -> RolloutWorker:
    """The rollout role's batch-building half, without an engine, data or grader."""
    cfg = build_config({"grpo": {"group_size": 2, **grpo}, "optim": {"rollout_batch_size": 2}})
    w = RolloutWorker.__new__(RolloutWorker)
    w.cfg, w.group_size = cfg, 2
    w.tokenizer = SimpleNamespace(pad_token_id=EOS, eos_token_id=EOS, bos_token_id=1)
    return w


# Prompt [7, 8]; the first response ended with eos after 3 tokens, the second was cut after 5.
ROLLOUT = rollout_rows([[7, 8], [7, 8]], [[5, 6, EOS], [5, 6, 9, 9, 9]], ["eos", "length"], texts=["a", "b"])
GRADES = [{"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0},
          {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}]


def test_the_eos_that_ends_a_response_is_trained_and_the_padding_after_it_is_not():
    batch, _ = worker().to_batch(ROLLOUT, GRADES)
    assert batch.input_ids.tolist() == [[7, 8, 5, 6, EOS, EOS, EOS], [7, 8, 5, 6, 9, 9, 9]]
    # Label column t scores token t+1: columns 1..3 are the first response (5, 6, eos), 1..5 the second.
    assert batch.response_mask.tolist() == [[0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]]


def test_train_on_eos_false_is_the_original_mask():
    batch, _ = worker(train_on_eos=False).to_batch(ROLLOUT, GRADES)
    assert batch.response_mask.tolist() == [[0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1]]


def test_the_grpo_clip_loss_reaches_the_eos_log_prob_with_the_responses_advantage():
    # The real loss and reduction: the rewarded response (advantage +1/sqrt(2) / std) has its eos
    # log-prob raised by a descent step, 1/3 of its advantage per token (sequence mean over 3 tokens,
    # mean over 2 rows).
    batch, _ = worker().to_batch(ROLLOUT, GRADES)
    logp = torch.full((2, 6), -1.0, requires_grad=True)
    per_token, _ = compute_policy_gradient_loss(logp, "grpo_clip", advantages=batch.advantages,
                                                old_log_probs=logp.detach(), cliprange=0.2)
    aggregate_loss(per_token, batch.response_mask, "sequence").backward()
    a = batch.advantages[0].item()
    assert a > 0
    assert logp.grad[0, 3].item() == pytest.approx(-a / 3 / 2)
    off, _ = worker(train_on_eos=False).to_batch(ROLLOUT, GRADES)
    logp.grad = None
    per_token, _ = compute_policy_gradient_loss(logp, "grpo_clip", advantages=off.advantages,
                                                old_log_probs=logp.detach(), cliprange=0.2)
    aggregate_loss(per_token, off.response_mask, "sequence").backward()
    assert logp.grad[0, 3].item() == 0.0  # the original's mask: stopping is never rewarded


# ------------------------------------------------------------------ SFT: each target ends with the eos

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"
SOLUTION = "He has 3 + 4 = 7 apples.\n#### 7"


def test_a_chat_sft_target_ends_with_the_end_of_turn_token_and_trains_it():
    from transformers import AutoTokenizer

    from rlft.data import Example
    from rlft.data.prompts import Prompt
    from rlft.roles.sft_data import build_sft_data, sft_batch
    from tiny_models import qwen_tokenizer_dir

    qwen = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    assert qwen.eos_token == "<|im_end|>"  # Qwen2.5's chat tokenizer: eos is the end of a turn
    example = Example(index=0, question=QUESTION, ground_truth="7", source="test", solution=SOLUTION)
    prompt = Prompt("chat", answer_format="boxed")
    with_eos = build_sft_data([example], qwen, template=prompt, end_with_eos=True)
    without = build_sft_data([example], qwen, template=prompt)
    assert with_eos.num_tokens == [without.num_tokens[0] + 1]
    batch = sft_batch(with_eos, [0], qwen, end_with_eos=True)
    target = qwen(with_eos.targets[0], add_special_tokens=False)["input_ids"]
    ids = batch.input_ids[0].tolist()
    assert ids[-len(target) - 1:] == target + [qwen.eos_token_id]
    # The mask covers the target and its end-of-turn (label column t scores token t+1) and nothing else.
    mask = batch.response_mask[0]
    assert mask.sum().item() == len(target) + 1 and mask[-1].item() == 1.0
    original = sft_batch(without, [0], qwen)
    assert original.response_mask[0].sum().item() == len(target)
    assert original.input_ids[0].tolist()[-1] != qwen.eos_token_id


def test_sft_end_with_eos_is_the_default():
    from rlft.config import build_config

    assert build_config({}).sft.end_with_eos is True
    assert build_config({}).grpo.train_on_eos is True
