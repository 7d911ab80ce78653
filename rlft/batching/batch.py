"""The training batch: prompt + response token ids padded into one typed structure, with the
response mask and the per-sequence / per-token inputs the losses read.

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

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

__all__ = [
    "Labels",
    "RolloutBatch",
    "build_rollout_batch",
    "tokenize_prompt_and_output",
    "used_width",
]


@dataclass
class RolloutBatch:
    """``B`` sequences (prompt + response) padded into one batch: what the policy trains on.

    Token-aligned ``[B, T]``: ``input_ids``, ``attention_mask`` (long).
    Label-aligned ``[B, T-1]`` (column t scores token t+1): ``response_mask`` (float), the
    ``sampler_logprobs`` (float32) the rollout engine reported for the response tokens (0 elsewhere),
    and the ``old_logprobs`` / ``ref_logprobs`` / ``teacher_logprobs`` (float32) that later steps may add.
    Per sequence ``[B]``: ``prompt_lengths``, ``response_lengths`` (long; eos/bos included), and the
    ``advantages`` / ``raw_rewards`` (float) of a graded rollout.

    The fields are filled in the step's order: the rollout role builds the batch with its
    advantages, the reference role adds ``ref_logprobs``, the teacher (distillation) its
    ``teacher_logprobs`` and the step's ``distill_weight``, the policy its own ``old_logprobs``.
    SFT batches leave the optional fields None.
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    prompt_lengths: Tensor
    response_lengths: Tensor
    advantages: Optional[Tensor] = None
    raw_rewards: Optional[Tensor] = None
    ref_logprobs: Optional[Tensor] = None
    old_logprobs: Optional[Tensor] = None
    sampler_logprobs: Optional[Tensor] = None
    teacher_logprobs: Optional[Tensor] = None  # [B, T-1]: the teacher's (distill.signal)
    distill_weight: Optional[Tensor] = None  # [B]: the step's distill.weight, per sequence

    @property
    def labels(self) -> Tensor:
        """``[B, T-1]`` long: the token each label column scores, ``input_ids[:, 1:]`` (pad ids included)."""
        return self.input_ids[:, 1:]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, rows: slice) -> RolloutBatch:
        """The batch of the sequences at ``rows`` (views of every tensor)."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)
                                            if getattr(self, f.name) is not None})

    def flush_left(self) -> RolloutBatch:
        """The same rows with each one's tokens moved to start at column 0: ``[pad..., prompt,
        response, pad...]`` becomes ``[prompt, response, pad...]``.

        Every token-aligned and label-aligned tensor of a row moves by the row's count of leading
        pads ``s`` (column ``c`` takes column ``c + s``; the leading pads wrap round to the end), so
        label column ``c`` still scores token ``c + 1`` and the labels that wrap round are padding,
        outside the response mask.  Per-sequence fields are unchanged.  With no pad before any token,
        attention needs no padding mask (causal attention alone is exact for every real token), and a
        micro-batch is as wide as its longest row rather than the longest prompt plus response.
        """
        lead = (self.attention_mask.long().cumsum(1) == 0).sum(1)  # [B] leading pads per row
        if not bool(lead.any()):
            return self

        def roll(t: Tensor) -> Tensor:
            width = t.shape[1]
            cols = (torch.arange(width, device=t.device)[None, :] + lead.to(t.device)[:, None]) % width
            return t.gather(1, cols)

        return dataclasses.replace(self, **{f.name: roll(getattr(self, f.name)) for f in dataclasses.fields(self)
                                            if getattr(self, f.name) is not None and getattr(self, f.name).dim() == 2})


@dataclass
class Labels:
    """What a loss reads on the last pipeline stage, for one micro-batch: the response mask and
    whichever of the batch's training inputs the objective names in its ``label_fields``.

    DeepSpeed moves labels between its data iterator and the loss as a tuple of tensors:
    :meth:`pack` and :meth:`unpack` turn this structure into that tuple and back, in the
    objective's field order.
    """

    response_mask: Tensor  # [b, T-1] float
    advantages: Optional[Tensor] = None  # [b]
    raw_rewards: Optional[Tensor] = None  # [b]
    ref_logprobs: Optional[Tensor] = None  # [b, T-1]
    old_logprobs: Optional[Tensor] = None  # [b, T-1]
    sampler_logprobs: Optional[Tensor] = None  # [b, T-1]
    teacher_logprobs: Optional[Tensor] = None  # [b, T-1]
    distill_weight: Optional[Tensor] = None  # [b]

    @classmethod
    def of(cls, batch: RolloutBatch, fields: Sequence[str], optional: Sequence[str] = ()) -> Labels:
        """The named fields of ``batch``, as float tensors.  A field named in ``optional`` that the
        batch lacks becomes an empty ``[B, 0]`` tensor, so that the tuple DeepSpeed carries keeps its
        layout; :meth:`unpack` turns it back into None."""
        missing = [name for name in fields if getattr(batch, name) is None and name not in optional]
        if missing:
            raise ValueError(f"the batch has no {', '.join(missing)}; the objective reads them")
        empty = torch.zeros((len(batch), 0))
        return cls(**{name: empty if getattr(batch, name) is None else getattr(batch, name).float()
                      for name in fields})

    def select(self, rows: slice, width: int) -> Labels:
        """The micro-batch of ``rows``, its label-aligned tensors cut to a token width of ``width``."""
        return Labels(**{f.name: _cut(getattr(self, f.name), rows, width) for f in dataclasses.fields(self)
                         if getattr(self, f.name) is not None})

    def pack(self, fields: Sequence[str]) -> tuple[Tensor, ...]:
        return tuple(getattr(self, name) for name in fields)

    @classmethod
    def unpack(cls, fields: Sequence[str], tensors: Sequence[Tensor]) -> Labels:
        """The inverse of :meth:`pack`; an empty tensor (an absent optional field) becomes None."""
        return cls(**{name: None if t.numel() == 0 and t.dim() == 2 else t
                      for name, t in zip(fields, tensors, strict=True)})


def _cut(t: Tensor, rows: slice, width: int) -> Tensor:
    """Rows of a per-sequence ``[B]`` or label-aligned ``[B, T-1]`` tensor, the latter cut to
    ``width - 1`` label columns (the labels of the first ``width`` tokens)."""
    return t[rows] if t.dim() == 1 else t[rows, :width - 1]


def used_width(attention_mask: Tensor) -> int:
    """Token columns up to the last one that any row uses (at least 2, so one label remains):
    cutting a micro-batch to it drops only trailing padding."""
    used = int(attention_mask.any(0).nonzero().max().item()) + 1 if attention_mask.any() else 1
    return max(used, 2)


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
    response_logprobs: Optional[Sequence[Sequence[float]]] = None,
    response_mask: Optional[Sequence[Sequence[int]]] = None,
) -> RolloutBatch:
    """Pad prompt + response token ids into one batch with a response mask.

    Args:
        prompt_ids: B unpadded prompts (token ids, each non-empty: the first response token
            needs a preceding token to be predicted from).
        response_ids: B unpadded responses (may be empty).
        pad_token_id: id written into padding positions.
        eos_token_id, bos_token_id: ids kept out of the response mask (None: exclude nothing).
        padding_side: ``"right"`` or ``"left"``, see the module docstring.
        pad_to_multiple_of: round T up to a multiple of this (extra padding goes on the right).
        response_logprobs: B lists, one log-prob per response token (the sampler's); they become
            ``sampler_logprobs`` at the labels that score those tokens, 0 elsewhere.
        response_mask: B lists, one 0/1 per response token (an episode's ``response_mask``): 1 where
            the model wrote the token, 0 where it was inserted (a tool's result and the chat template's
            turn markers in a multi-turn episode).  Inserted tokens stay in the sequence, so later
            tokens are scored with them in context, but never in the batch's (label-aligned)
            ``response_mask``.  None: every token is the model's.

    Returns:
        A :class:`RolloutBatch` (its optional training inputs None, but ``sampler_logprobs`` when
        given): ``input_ids [B, T]``, ``attention_mask [B, T]``, ``response_mask [B, T-1]``,
        ``prompt_lengths [B]``, ``response_lengths [B]`` (every response token, inserted ones too).
    """
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    prompts, responses = _checked_rows(prompt_ids, response_ids, response_logprobs, response_mask)
    p_len, r_len = [len(p) for p in prompts], [len(r) for r in responses]
    layout = _layout(p_len, r_len, padding_side, pad_to_multiple_of)
    input_ids, attention_mask, token_response_mask, sampler_logprobs = _fill_rows(
        prompts, responses, layout, pad_token_id, response_logprobs, response_mask)
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=_response_mask(token_response_mask, attention_mask, input_ids, (eos_token_id, bos_token_id)),
        prompt_lengths=torch.tensor(p_len, dtype=torch.long),
        response_lengths=torch.tensor(r_len, dtype=torch.long),
        sampler_logprobs=sampler_logprobs,
    )


def _fill_rows(prompts: list[list[int]], responses: list[list[int]], layout: tuple[list[int], list[int], int],
               pad_token_id: int, response_logprobs, response_mask
               ) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Write each row's prompt and response into the batch's tensors at the places ``layout``
    (:func:`_layout`) gives: ``(input_ids, attention_mask, token_response_mask, sampler_logprobs)``,
    where ``token_response_mask [B, T]`` marks the token positions (not labels) of the model's response
    tokens and ``sampler_logprobs`` is None without ``response_logprobs``."""
    prompt_start, response_start, width = layout
    batch = len(prompts)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    token_response_mask = torch.zeros((batch, width), dtype=torch.bool)  # token positions, not labels
    sampler_logprobs = None if response_logprobs is None else torch.zeros((batch, width - 1))
    for i in range(batch):
        r_len = len(responses[i])
        a, b, c = prompt_start[i], response_start[i], response_start[i] + r_len
        input_ids[i, a:b] = torch.tensor(prompts[i], dtype=torch.long)
        attention_mask[i, a:c] = 1
        if not r_len:
            continue
        input_ids[i, b:c] = torch.tensor(responses[i], dtype=torch.long)
        if sampler_logprobs is not None:  # token t is scored by label column t - 1
            sampler_logprobs[i, b - 1:c - 1] = torch.tensor(response_logprobs[i], dtype=torch.float32)
        everything = response_mask is None or 0 not in response_mask[i]  # a single turn: every token the model's
        token_response_mask[i, b:c] = True if everything else torch.tensor(response_mask[i], dtype=torch.bool)
    return input_ids, attention_mask, token_response_mask, sampler_logprobs


def _response_mask(token_response_mask: Tensor, attention_mask: Tensor, input_ids: Tensor,
                   excluded_ids: Sequence[Optional[int]]) -> Tensor:
    """The label-aligned ``[B, T-1]`` float response mask: response token positions that the
    attention mask keeps and whose id is none of ``excluded_ids`` (None entries exclude nothing)."""
    # Padding is whatever the attention mask leaves out, whatever its id (pad may equal eos).
    keep = token_response_mask & attention_mask.bool()
    for special in excluded_ids:
        if special is not None:
            keep &= input_ids != special
    # Label column t predicts token t+1, so the token mask shifts left by one.
    return keep[:, 1:].float()


def _checked_rows(prompt_ids, response_ids, response_logprobs, response_mask):
    """The prompts and responses as lists of ints, once every per-row input pairs up with them."""
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
    for name, per_token in (("response_logprobs", response_logprobs), ("response_mask", response_mask)):
        if per_token is None:
            continue
        if len(per_token) != len(responses):
            raise ValueError(f"got {len(per_token)} lists of {name} for {len(responses)} responses")
        for i, (values, r) in enumerate(zip(per_token, responses)):
            if len(values) != len(r):
                raise ValueError(f"{name}[{i}] has {len(values)} values for {len(r)} response tokens")
    return prompts, responses


def _layout(p_len: list[int], r_len: list[int], padding_side: str,
            pad_to_multiple_of: Optional[int]) -> tuple[list[int], list[int], int]:
    """Where each row's prompt and response start, and the batch's width (module docstring's layouts)."""
    if padding_side == "right":
        prompt_start, response_start = [0] * len(p_len), p_len
        width = max(p + r for p, r in zip(p_len, r_len))
    else:
        p_max = max(p_len)
        prompt_start, response_start = [p_max - p for p in p_len], [p_max] * len(p_len)
        width = p_max + max(r_len)
    return prompt_start, response_start, _round_up(width, pad_to_multiple_of)


def tokenize_prompt_and_output(
    prompt_strs: Sequence[str],
    output_strs: Sequence[str],
    tokenizer: Any,
    padding_side: str = "right",
    pad_to_multiple_of: Optional[int] = None,
    append_eos: bool = False,
) -> RolloutBatch:
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
        append_eos: each output ends with the tokenizer's eos token (a chat model's end-of-turn), in
            the response mask, so the model learns to stop there; the other eos ids stay out.

    Returns:
        The batch of :func:`build_rollout_batch`.
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
    output_ids = output_enc["input_ids"]
    special = {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}
    if append_eos:
        if tokenizer.eos_token_id is None:
            raise ValueError("append_eos: the tokenizer has no eos token to end the outputs with")
        output_ids = [list(ids) + [tokenizer.eos_token_id] for ids in output_ids]
        # The appended eos is a target, also where bos has the same id; outputs tokenised without
        # special tokens hold no other eos or bos.
        special = {}
    return build_rollout_batch(
        prompt_ids,
        output_ids,
        pad_token_id=pad_id,
        **special,
        padding_side=padding_side,
        pad_to_multiple_of=pad_to_multiple_of,
    )
