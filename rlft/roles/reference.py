"""The reference role: a frozen copy of the starting policy that scores rollouts.  With LoRA and the
reference on a policy rank the policy scores them itself, adapters off, and this role is not built
(`rlft.config.role_records.reference_logprobs_by` decides).

It computes per-token log-probs with exactly the trainer's conventions (positions from the
attention mask, so left and right padding give the same numbers; column t scores token t+1), under
inference mode, one micro-batch at a time.
"""
from __future__ import annotations

import torch

from rlft.batching.batch import RolloutBatch
from rlft.models.loading import load_causal_lm


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) -> [B, T-1] (fp32), for an HF causal LM."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits[:, :-1]
    targets = input_ids[:, 1:, None]
    # One row at a time in fp32: a [T, V] copy instead of [B, T, V] (a 150k vocabulary's micro-batch of 16
    # rows of 700 tokens would take 6.8 GB twice); the numbers are the same.
    return torch.stack([torch.log_softmax(logits[i].float(), -1).gather(-1, targets[i]).squeeze(-1)
                        for i in range(logits.shape[0])])


class ReferenceModel:
    def __init__(self, model_path: str, *, dtype: str, device: torch.device, micro_batch_size: int,
                 attn_implementation: str = "sdpa"):
        self.device, self.micro_batch_size = device, micro_batch_size
        self.model = load_causal_lm(model_path, dtype=dtype, device=str(device),
                                    attn_implementation=attn_implementation)
        self.model.eval().requires_grad_(False)

    @torch.inference_mode()
    def logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The batch's per-token log-probs ``[B, T-1]``, on the CPU."""
        out = []
        for i in range(0, len(batch), self.micro_batch_size):
            ids = batch.input_ids[i:i + self.micro_batch_size].to(self.device)
            mask = batch.attention_mask[i:i + self.micro_batch_size].to(self.device)
            out.append(sequence_logprobs(self.model, ids, mask).cpu())
        return torch.cat(out)
