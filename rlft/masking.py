"""Training batches from prompts and responses: padding, labels and the response mask.

The trainer's convention: the policy pipeline takes ``input_ids [B, T]`` (prompt + response) and
``attention_mask [B, T]`` and returns per-token log-probs ``[B, T-1]`` whose column t is
``log p(input_ids[:, t+1] | input_ids[:, :t+1])``. Everything label-aligned here
(``labels``, ``response_mask``) is therefore ``[B, T-1]`` and indexed like ``input_ids[:, 1:]``.

Layouts (``P_i`` prompt tokens, ``R_i`` response tokens of row i):

* ``padding_side="right"``: ``[prompt_i, response_i, pad...]``; the response starts at ``P_i``.
* ``padding_side="left"``: ``[pad..., prompt_i, response_i, pad...]``; prompts are left-padded to
  the longest prompt ``P_max`` so every response starts at column ``P_max``, and responses are
  right-padded after it (the layout a generation engine sees).

The response mask is 1 exactly on labels that are response tokens: positions
``[response_start, response_start + R_i)`` of ``input_ids`` (shifted by one into label space),
never on padding (decided by position / attention mask, not by token id, so ``pad == eos`` is
safe) and never on eos or bos token ids.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

__all__ = [
    "build_rollout_batch",
    "split_micro_batches",
    "tokenize_prompt_and_output",
    "trim_padding",
]


def _as_id_list(seq: Any, what: str, index: int) -> list[int]:
    if isinstance(seq, Tensor):
        seq = seq.tolist()
    try:
        return [int(t) for t in seq]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}[{index}] must be a sequence of token ids, got {seq!r}") from exc


def _round_up(n: int, multiple: Optional[int]) -> int:
    if multiple is None:
        return n
    if multiple < 1:
        raise ValueError(f"pad_to_multiple_of must be a positive int, got {multiple!r}")
    return int(math.ceil(n / multiple) * multiple)


def build_rollout_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    eos_token_id: Optional[int] = None,
    bos_token_id: Optional[int] = None,
    padding_side: str = "right",
    pad_to_multiple_of: Optional[int] = None,
) -> dict[str, Tensor]:
    """Pad prompt + response token ids into one batch with labels and a response mask.

    Args:
        prompt_ids: B unpadded prompts (token ids, each non-empty: the first response token
            needs a preceding token to be predicted from).
        response_ids: B unpadded responses (may be empty).
        pad_token_id: id written into padding positions.
        eos_token_id, bos_token_id: ids kept out of the response mask (None: exclude nothing).
        padding_side: ``"right"`` or ``"left"``, see the module docstring.
        pad_to_multiple_of: round T up to a multiple of this (extra padding goes on the right).

    Returns:
        ``input_ids [B, T]`` long, ``attention_mask [B, T]`` long, ``labels [B, T-1]`` long
        (``input_ids[:, 1:]``, pad ids included), ``response_mask [B, T-1]`` float,
        ``prompt_lengths [B]`` long (prompt token counts), ``response_lengths [B]`` long
        (response token counts, eos/bos included).
    """
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    if len(prompt_ids) != len(response_ids):
        raise ValueError(
            f"got {len(prompt_ids)} prompts but {len(response_ids)} responses; they must pair up"
        )
    if len(prompt_ids) == 0:
        raise ValueError("cannot build a batch from zero prompts")
    prompts = [_as_id_list(p, "prompt_ids", i) for i, p in enumerate(prompt_ids)]
    responses = [_as_id_list(r, "response_ids", i) for i, r in enumerate(response_ids)]
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt_ids[{i}] is empty; every prompt needs at least one token")

    batch = len(prompts)
    p_len = [len(p) for p in prompts]
    r_len = [len(r) for r in responses]
    if padding_side == "right":
        prompt_start = [0] * batch
        response_start = p_len
        width = max(p + r for p, r in zip(p_len, r_len))
    else:
        p_max = max(p_len)
        prompt_start = [p_max - p for p in p_len]
        response_start = [p_max] * batch
        width = p_max + max(r_len)
    width = _round_up(width, pad_to_multiple_of)

    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    is_response = torch.zeros((batch, width), dtype=torch.bool)  # token positions, not labels
    for i in range(batch):
        a, b, c = prompt_start[i], response_start[i], response_start[i] + r_len[i]
        input_ids[i, a:b] = torch.tensor(prompts[i], dtype=torch.long)
        if r_len[i]:
            input_ids[i, b:c] = torch.tensor(responses[i], dtype=torch.long)
        attention_mask[i, a:c] = 1
        is_response[i, b:c] = True

    # Padding is whatever the attention mask leaves out, whatever its id (pad may equal eos).
    keep = is_response & attention_mask.bool()
    for special in (eos_token_id, bos_token_id):
        if special is not None:
            keep &= input_ids != special

    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": input_ids[:, 1:].clone(),
        # Label column t predicts token t+1, so the token mask shifts left by one.
        "response_mask": keep[:, 1:].float(),
        "prompt_lengths": torch.tensor(p_len, dtype=torch.long),
        "response_lengths": torch.tensor(r_len, dtype=torch.long),
    }


def tokenize_prompt_and_output(
    prompt_strs: Sequence[str],
    output_strs: Sequence[str],
    tokenizer: Any,
    padding_side: str = "right",
    pad_to_multiple_of: Optional[int] = None,
) -> dict[str, Tensor]:
    """Tokenise prompts and outputs separately and build the batch (the SFT path).

    The prompt is tokenised with the tokenizer's default ``add_special_tokens`` (so a tokenizer
    that prepends BOS, like Llama's, does so here, as at generation time); the output with
    ``add_special_tokens=False`` since it continues the prompt. The prompt's tokens are those its
    attention mask keeps (a token count, not a character count). Padding uses the tokenizer's pad
    token, or its eos token when it has none; eos and bos ids are left out of the response mask.

    Args:
        prompt_strs, output_strs: B strings each.
        tokenizer: a Hugging Face tokenizer (callable on a list of strings).
        padding_side, pad_to_multiple_of: as in :func:`build_rollout_batch`.

    Returns:
        The dict of :func:`build_rollout_batch`.
    """
    if len(prompt_strs) != len(output_strs):
        raise ValueError(
            f"got {len(prompt_strs)} prompts but {len(output_strs)} outputs; they must pair up"
        )
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("tokenizer has neither a pad token nor an eos token to pad with")

    prompt_enc = tokenizer(list(prompt_strs))
    output_enc = tokenizer(list(output_strs), add_special_tokens=False)
    prompt_ids = [
        [tok for tok, keep in zip(ids, mask) if keep]
        for ids, mask in zip(prompt_enc["input_ids"], prompt_enc["attention_mask"])
    ]
    return build_rollout_batch(
        prompt_ids,
        output_enc["input_ids"],
        pad_token_id=pad_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        padding_side=padding_side,
        pad_to_multiple_of=pad_to_multiple_of,
    )


def _batch_size(batch: dict[str, Any]) -> int:
    if isinstance(batch.get("input_ids"), Tensor):
        return batch["input_ids"].shape[0]
    for value in batch.values():
        if isinstance(value, Tensor) and value.dim() >= 1:
            return value.shape[0]
    raise ValueError("batch holds no tensor with a batch dimension")


def split_micro_batches(batch: dict[str, Any], micro_batch_size: int) -> list[dict[str, Any]]:
    """Split every ``[B, ...]`` tensor of ``batch`` along dim 0 into chunks of ``micro_batch_size``.

    B is ``input_ids``' first dim (or the first tensor's). Values that are not tensors, or are
    0-d tensors, are copied into every micro-batch. If ``micro_batch_size`` does not divide B the
    last micro-batch is smaller.

    Returns:
        ``ceil(B / micro_batch_size)`` dicts with the same keys.
    """
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    n = _batch_size(batch)
    for key, value in batch.items():
        if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] != n:
            raise ValueError(
                f"batch[{key!r}] has {value.shape[0]} rows but the batch has {n}; "
                "cannot split it consistently"
            )
    chunks = []
    for start in range(0, n, micro_batch_size):
        end = min(start + micro_batch_size, n)
        chunks.append(
            {
                key: value[start:end] if isinstance(value, Tensor) and value.dim() >= 1 else value
                for key, value in batch.items()
            }
        )
    return chunks


def trim_padding(
    batch: dict[str, Any], pad_to_multiple_of: Optional[int] = None
) -> dict[str, Any]:
    """Drop the leading and trailing columns that are padding in every row.

    After :func:`split_micro_batches` a micro-batch is often narrower than the whole batch.
    Columns are judged by ``attention_mask``. Tensors with ``T`` columns (token-aligned, e.g.
    ``input_ids``) lose the same columns; tensors with ``T-1`` columns (label-aligned, e.g.
    ``labels``, ``response_mask``, old/ref log-probs) lose the matching label columns; all other
    values pass through.

    Args:
        batch: a dict holding ``attention_mask [B, T]``.
        pad_to_multiple_of: keep the width a multiple of this (widening into padding; never
            beyond T).

    Returns:
        A new dict (tensors are views of the originals).
    """
    if "attention_mask" not in batch:
        raise ValueError("trim_padding needs batch['attention_mask']")
    attention = batch["attention_mask"]
    width = attention.shape[1]
    used = attention.bool().any(dim=0).nonzero().flatten()
    if used.numel() == 0:
        raise ValueError("attention_mask is all zero; nothing to keep")
    lo, hi = int(used[0]), int(used[-1]) + 1
    new_width = min(_round_up(hi - lo, pad_to_multiple_of), width)
    hi = min(width, lo + new_width)
    lo = hi - new_width
    out = {}
    for key, value in batch.items():
        if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == width:
            out[key] = value[:, lo:hi]
        elif isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == width - 1:
            # Label column t predicts token t+1: tokens [lo, hi) keep labels [lo, hi-1).
            out[key] = value[:, lo : hi - 1]
        else:
            out[key] = value
    return out
