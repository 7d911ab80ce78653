"""Rollout batch building: padding layouts, labels and the response mask, checked by hand; the
rows and micro-batch labels the policy cuts from a batch."""

import dataclasses
import random

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from rlft.batching.batch import Labels, build_rollout_batch, tokenize_prompt_and_output, used_width

PAD, BOS, EOS = 0, 1, 2
VOCAB = {
    "<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "what": 4, "is": 5, "two": 6, "plus": 7,
    "three": 8, "?": 9, "<answer>": 10, "</answer>": 11, "five": 12, "four": 13,
}


def make_tokenizer(with_pad: bool = True) -> PreTrainedTokenizerFast:
    """Word-level tokenizer that prepends <s> when add_special_tokens is on (like Llama's)."""
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)]
    )
    special = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if with_pad:
        special["pad_token"] = "<pad>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def as_lists(batch):
    out = {f.name: getattr(batch, f.name).tolist() for f in dataclasses.fields(batch)
           if getattr(batch, f.name) is not None}
    return {**out, "labels": batch.labels.tolist()}


# ------------------------------------------------------------------ build_rollout_batch


def test_right_padding_prompts_of_different_lengths():
    b = build_rollout_batch(
        [[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], pad_token_id=PAD, eos_token_id=EOS,
        bos_token_id=BOS,
    )
    out = as_lists(b)
    # row 0 = 3 prompt + 2 response = 5; row 1 = 1 + 3 = 4 → T = 5
    assert out["input_ids"] == [[5, 6, 7, 9, 10], [8, 11, 12, 13, PAD]]
    assert out["attention_mask"] == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert out["labels"] == [[6, 7, 9, 10], [11, 12, 13, PAD]]
    # response tokens sit at positions 3,4 (row 0) and 1,2,3 (row 1); label t predicts token t+1
    assert out["response_mask"] == [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert out["prompt_lengths"] == [3, 1]
    assert out["response_lengths"] == [2, 3]
    assert b.input_ids.dtype == torch.long and b.attention_mask.dtype == torch.long
    assert b.labels.dtype == torch.long and b.response_mask.dtype == torch.float32
    assert b.advantages is None and b.raw_rewards is None and b.ref_logprobs is None and b.old_logprobs is None


def test_flush_left_moves_each_row_to_column_0_with_its_labels():
    b = build_rollout_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], pad_token_id=PAD, eos_token_id=EOS,
                            bos_token_id=BOS, padding_side="left", response_logprobs=[[-1.0, -2.0], [-3.0, -4.0, -5.0]])
    b.advantages = torch.tensor([0.5, -0.5])
    f = b.flush_left()
    out = as_lists(f)
    # row 1 had 2 leading pads: they wrap round to the end; row 0 had none
    assert out["input_ids"] == [[5, 6, 7, 9, 10, PAD], [8, 11, 12, 13, PAD, PAD]]
    assert out["attention_mask"] == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]
    assert out["labels"] == [[6, 7, 9, 10, PAD], [11, 12, 13, PAD, PAD]]
    # label column c still scores token c + 1: row 1's response tokens 11, 12, 13 are labels 0..2
    assert out["response_mask"] == [[0, 0, 1, 1, 0], [1, 1, 1, 0, 0]]
    assert f.sampler_logprobs.tolist() == [[0, 0, -1, -2, 0], [-3, -4, -5, 0, 0]]
    # per-sequence fields are the rows' own
    assert out["prompt_lengths"] == [3, 1] and f.advantages.tolist() == [0.5, -0.5]
    assert f.flush_left() is f  # nothing left to move
    assert used_width(f.attention_mask) == 5


def test_left_padding_aligns_responses_after_the_longest_prompt():
    out = as_lists(
        build_rollout_batch(
            [[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], pad_token_id=PAD, eos_token_id=EOS,
            bos_token_id=BOS, padding_side="left",
        )
    )
    # longest prompt 3, longest response 3 → T = 6; every response starts at column 3
    assert out["input_ids"] == [[5, 6, 7, 9, 10, PAD], [PAD, PAD, 8, 11, 12, 13]]
    assert out["attention_mask"] == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert out["labels"] == [[6, 7, 9, 10, PAD], [PAD, 8, 11, 12, 13]]
    # tokens 3.. are responses → label columns 2..
    assert out["response_mask"] == [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert out["prompt_lengths"] == [3, 1]
    assert out["response_lengths"] == [2, 3]


@pytest.mark.parametrize("side", ["right", "left"])
def test_sampler_logprobs_sit_at_the_labels_of_their_tokens(side):
    # Row 0: prompt [5,6,7], response [9,10] with log-probs -0.1, -0.2; row 1: [8] then [11,12,EOS].
    b = build_rollout_batch(
        [[5, 6, 7], [8]], [[9, 10], [11, 12, EOS]], pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
        padding_side=side, response_logprobs=[[-0.1, -0.2], [-1.0, -2.0, -3.0]],
    )
    got = b.sampler_logprobs
    if side == "right":
        # labels [[6,7,9,10],[11,12,EOS,PAD]]: the log-prob of token t sits in label column t-1
        assert torch.equal(got, torch.tensor([[0, 0, -0.1, -0.2], [-1.0, -2.0, -3.0, 0]]))
        assert b.response_mask.tolist() == [[0, 0, 1, 1], [1, 1, 0, 0]]
    else:
        # labels [[6,7,9,10,PAD],[PAD,8,11,12,EOS]]
        assert torch.equal(got, torch.tensor([[0, 0, -0.1, -0.2, 0], [0, 0, -1.0, -2.0, -3.0]]))
        assert b.response_mask.tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 1, 0]]
    assert b.sampler_logprobs.dtype == torch.float32
    with pytest.raises(ValueError, match=r"response_logprobs\[1\] has 2 values for 3 response tokens"):
        build_rollout_batch([[5], [8]], [[9], [11, 12, 13]], pad_token_id=PAD, response_logprobs=[[0.0], [0.0, 0.0]])
    assert build_rollout_batch([[5]], [[9]], pad_token_id=PAD).sampler_logprobs is None


def test_pad_equal_to_eos_is_decided_by_attention_not_id():
    # pad id == eos id == 2; row 0's response ends with a real eos, row 1 is padded with 2s
    prompts, responses = [[5, 6], [7]], [[9, EOS], [10]]
    out = as_lists(build_rollout_batch(prompts, responses, pad_token_id=EOS, eos_token_id=EOS))
    assert out["input_ids"] == [[5, 6, 9, EOS], [7, 10, EOS, EOS]]
    # the trailing 2 of row 0 is a real token, the two 2s of row 1 are padding
    assert out["attention_mask"] == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert out["labels"] == [[6, 9, EOS], [10, EOS, EOS]]
    # row 0: response = positions 2,3 → labels 1,2, but label 2 is eos → excluded
    assert out["response_mask"] == [[0, 1, 0], [1, 0, 0]]
    assert out["response_lengths"] == [2, 1]
    # eos_token_id=None keeps the real eos in the mask; the padding 2s stay out regardless
    out = as_lists(build_rollout_batch(prompts, responses, pad_token_id=EOS, eos_token_id=None))
    assert out["response_mask"] == [[0, 1, 1], [1, 0, 0]]


def test_bos_and_eos_inside_response_are_excluded():
    # prompt [<s>, 5]; response [6, <s>, 7, </s>]
    out = as_lists(
        build_rollout_batch([[BOS, 5]], [[6, BOS, 7, EOS]], pad_token_id=PAD, eos_token_id=EOS,
                            bos_token_id=BOS)
    )
    assert out["input_ids"] == [[BOS, 5, 6, BOS, 7, EOS]]
    assert out["labels"] == [[5, 6, BOS, 7, EOS]]
    # response positions 2..5 → labels 1..4 minus the bos (label 2) and eos (label 4)
    assert out["response_mask"] == [[0, 1, 0, 1, 0]]
    # the prompt's own bos is never in the mask anyway
    assert out["prompt_lengths"] == [2] and out["response_lengths"] == [4]


def test_pad_to_multiple_and_empty_response():
    out = as_lists(
        build_rollout_batch([[5, 6, 7], [8]], [[9, 10], []], pad_token_id=PAD, pad_to_multiple_of=4)
    )
    # natural T = 5 → 8; row 1 has no response at all
    assert out["input_ids"] == [[5, 6, 7, 9, 10, 0, 0, 0], [8, 0, 0, 0, 0, 0, 0, 0]]
    assert out["attention_mask"] == [[1, 1, 1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]]
    assert out["response_mask"] == [[0, 0, 1, 1, 0, 0, 0], [0] * 7]
    assert out["response_lengths"] == [2, 0]


def test_build_accepts_tensors_and_rejects_bad_input():
    out = build_rollout_batch([torch.tensor([5, 6])], [torch.tensor([7])], pad_token_id=PAD)
    assert out.input_ids.tolist() == [[5, 6, 7]]
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        build_rollout_batch([[5], [6]], [[7]], pad_token_id=PAD)
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] is empty"):
        build_rollout_batch([[5], []], [[7], [8]], pad_token_id=PAD)
    with pytest.raises(ValueError, match="padding_side"):
        build_rollout_batch([[5]], [[7]], pad_token_id=PAD, padding_side="center")
    with pytest.raises(ValueError, match="zero prompts"):
        build_rollout_batch([], [], pad_token_id=PAD)
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        build_rollout_batch([[5]], [[7]], pad_token_id=PAD, pad_to_multiple_of=0)


@pytest.mark.parametrize("side", ["right", "left"])
def test_mask_selects_exactly_the_response_tokens_randomised(side):
    # Independent check: reading labels through the mask must give back each response with
    # eos/bos removed, in order; and labels must be input_ids shifted by one.
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(1, 5)
        prompts = [[rng.randint(0, 9) for _ in range(rng.randint(1, 6))] for _ in range(n)]
        responses = [[rng.randint(0, 9) for _ in range(rng.randint(0, 6))] for _ in range(n)]
        b = build_rollout_batch(
            prompts, responses, pad_token_id=0, eos_token_id=EOS, bos_token_id=BOS,
            padding_side=side, pad_to_multiple_of=rng.choice([None, 4]),
        )
        assert torch.equal(b.labels, b.input_ids[:, 1:])
        for i in range(n):
            picked = b.labels[i][b.response_mask[i].bool()].tolist()
            assert picked == [t for t in responses[i] if t not in (EOS, BOS)]
            assert b.attention_mask[i].sum().item() == len(prompts[i]) + len(responses[i])


# ------------------------------------------------------------------ tokenize_prompt_and_output


def test_tokenize_prompt_and_output_right():
    tok = make_tokenizer()
    out = as_lists(
        tokenize_prompt_and_output(
            ["what is two plus three ?", "two plus two"],
            ["<answer> five </answer> </s>", "four"],
            tok,
        )
    )
    # prompts get <s> (default add_special_tokens): [1,4,5,6,7,8,9] (7 tokens), [1,6,7,6] (4)
    # outputs get none: [10,12,11,2] (4), [13] (1) → T = 11
    assert out["input_ids"] == [
        [1, 4, 5, 6, 7, 8, 9, 10, 12, 11, 2],
        [1, 6, 7, 6, 13, 0, 0, 0, 0, 0, 0],
    ]
    assert out["attention_mask"] == [[1] * 11, [1] * 5 + [0] * 6]
    assert out["prompt_lengths"] == [7, 4]
    assert out["response_lengths"] == [4, 1]
    # row 0: response at positions 7..10 → labels 6..9, the eos (label 9) excluded
    # row 1: response at position 4 → label 3
    assert out["response_mask"] == [
        [0, 0, 0, 0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 1, 0, 0, 0, 0, 0, 0],
    ]


def test_tokenize_prompt_and_output_left_and_pad_falls_back_to_eos():
    tok = make_tokenizer(with_pad=False)
    assert tok.pad_token_id is None
    out = as_lists(
        tokenize_prompt_and_output(
            ["what is two plus three ?", "two plus two"],
            ["<answer> five </answer> </s>", "four"],
            tok,
            padding_side="left",
        )
    )
    # pad = eos = 2; prompts left-padded to 7, responses right-padded to 4 → T = 11
    assert out["input_ids"] == [
        [1, 4, 5, 6, 7, 8, 9, 10, 12, 11, 2],
        [2, 2, 2, 1, 6, 7, 6, 13, 2, 2, 2],
    ]
    assert out["attention_mask"] == [[1] * 11, [0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0]]
    assert out["prompt_lengths"] == [7, 4]
    # every response starts at column 7 → label 6
    assert out["response_mask"] == [
        [0, 0, 0, 0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
    ]


def test_tokenize_rejects_mismatched_lists():
    with pytest.raises(ValueError, match="2 prompts but 1 outputs"):
        tokenize_prompt_and_output(["two", "two"], ["four"], make_tokenizer())


# ------------------------------------------------------------------ rows, micro-batches and labels


def _graded_batch():
    b = build_rollout_batch([[5, 6, 7], [8], [4, 4]], [[9, 10], [11, 12, 13], [5]], pad_token_id=PAD)
    b.advantages = torch.tensor([0.5, -0.5, 1.0])
    b.raw_rewards = torch.tensor([1.0, 0.0, 1.0])
    b.ref_logprobs = torch.arange(12, dtype=torch.float32).view(3, 4)  # [B, T-1], T = 5
    return b


def test_rows_select_every_field():
    b = _graded_batch()
    part = b.rows(slice(1, 3))
    assert len(part) == 2 and len(b) == 3
    assert part.input_ids.tolist() == [[8, 11, 12, 13, PAD], [4, 4, 5, PAD, PAD]]
    assert part.advantages.tolist() == [-0.5, 1.0]
    assert part.ref_logprobs.tolist() == [[4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]]
    assert part.old_logprobs is None
    for name in ("input_ids", "attention_mask", "response_mask", "prompt_lengths", "response_lengths"):
        assert torch.equal(torch.cat([getattr(b.rows(slice(0, 1)), name), getattr(part, name)]), getattr(b, name))


def test_micro_batch_labels_keep_token_and_label_columns_aligned():
    b = _graded_batch()
    fields = ("response_mask", "advantages", "ref_logprobs")
    labels = Labels.of(b, fields)
    assert labels.raw_rewards is None  # only what the objective names travels
    # Row 2 alone: [4,4,5,pad,pad] -> 3 tokens used, so labels keep 2 columns.
    width = used_width(b.attention_mask[2:3])
    assert width == 3
    micro = labels.select(slice(2, 3), width)
    assert micro.response_mask.tolist() == [[0.0, 1.0]]
    assert micro.ref_logprobs.tolist() == [[8.0, 9.0]]
    assert micro.advantages.tolist() == [1.0]
    # Through DeepSpeed's tuple and back, in the objective's field order.
    packed = micro.pack(fields)
    assert [t.shape for t in packed] == [(1, 2), (1,), (1, 2)]
    back = Labels.unpack(fields, packed)
    assert all(torch.equal(getattr(back, f), getattr(micro, f)) for f in fields) and back.raw_rewards is None
    # Rows 1-2 use 4 of 5 columns; a single token row still keeps one label column.
    assert used_width(b.attention_mask[1:]) == 4
    assert used_width(torch.tensor([[1, 0, 0]])) == 2
    with pytest.raises(ValueError, match="old_logprobs"):
        Labels.of(b, ("response_mask", "old_logprobs"))


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_inserted_tokens_of_an_episode_stay_in_context_but_out_of_the_response_mask(padding_side):
    """A 2-turn episode: the model's call (10, 11), the tool's result with the template's markers (90,
    91, 92, inserted), the model's answer (12, 13); a second row is an ordinary single-turn response."""
    batch = build_rollout_batch([[5, 6], [7]], [[10, 11, 90, 91, 92, 12, 13], [20, 21]], pad_token_id=0,
                                padding_side=padding_side, response_logprobs=[[-.1, -.2, 0, 0, 0, -.3, -.4], [-.5, -.6]],
                                response_mask=[[1, 1, 0, 0, 0, 1, 1], [1, 1]])
    # Row 0's prompt is the longest and its response the longest: the same columns in either layout.
    assert batch.input_ids[0].tolist() == [5, 6, 10, 11, 90, 91, 92, 12, 13]
    assert batch.attention_mask[0].tolist() == [1] * 9
    # Label column t scores token t+1: tokens 2, 3 (the call) and 7, 8 (the answer) are the model's.
    assert batch.response_mask[0].tolist() == [0, 1, 1, 0, 0, 0, 1, 1]
    assert batch.sampler_logprobs[0].tolist() == pytest.approx([0, -.1, -.2, 0, 0, 0, -.3, -.4])
    second = batch.response_mask[1].tolist()
    assert sum(second) == 2 and batch.response_lengths.tolist() == [7, 2]


def test_a_token_mask_must_match_its_response():
    with pytest.raises(ValueError, match=r"response_mask\[0\] has 2 values for 3 response tokens"):
        build_rollout_batch([[1]], [[2, 3, 4]], pad_token_id=0, response_mask=[[1, 0]])
