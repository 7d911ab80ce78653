"""A mixture of experts' load-balancing loss across the pipeline's stages (HF's ``aux_loss``).

HF's ``load_balancing_loss_func`` sums, over every layer with a router and every unpadded token, the
top-k assignments per expert and the routing probabilities per expert, then returns
``experts * sum_e (assigned_e / rows) * (probability_e / rows)`` (``rows``: the unpadded tokens times the
router layers).  The sums add layer by layer, so each stage adds its own layers' to one fp32 tensor
``[3, experts]`` that travels between stages beside the hidden state: row 0 the assignments, row 1 the
probabilities (the loss's gradient flows back through it to every stage's routers), row 2 the rows
counted (every column the same).  The first stage starts it at zero, the output layer turns it into the
loss (:func:`load_balancing_loss`), which the policy logs (``moe/aux_loss``) and adds to the loss with
the model config's ``router_aux_loss_coef`` where its ``output_router_logits`` is on (as HF does).
"""
from __future__ import annotations

import torch
import torch.nn as nn


def empty_router_statistics(experts: int, device: torch.device) -> torch.Tensor:
    """The sums before any layer: ``[3, experts]`` fp32 zeros."""
    return torch.zeros(3, experts, dtype=torch.float32, device=device)


def add_router_statistics(stats: torch.Tensor, router_logits: torch.Tensor, attention_mask: torch.Tensor,
                          top_k: int) -> torch.Tensor:
    """``stats`` plus one layer's: its router logits ``[B*T, experts]`` over the ``[B,T]`` mask's tokens."""
    experts = router_logits.shape[-1]
    probabilities = torch.softmax(router_logits, dim=-1)
    _, chosen = torch.topk(probabilities, top_k, dim=-1)
    mask = attention_mask.reshape(-1).to(torch.float32)
    assigned = torch.zeros(experts, dtype=torch.float32, device=stats.device).scatter_add_(
        0, chosen.reshape(-1), mask.repeat_interleave(top_k))
    probability = (probabilities.float() * mask[:, None]).sum(dim=0)
    return stats + torch.stack([assigned, probability, mask.sum().expand(experts)])


def load_balancing_loss(stats: torch.Tensor) -> torch.Tensor:
    """HF's ``aux_loss`` from the sums of every router layer (a scalar, fp32)."""
    rows = stats[2, 0].clamp(min=1.0)
    return stats.shape[1] * torch.sum((stats[0] / rows) * (stats[1] / rows))


class RouterLogits:
    """Keeps the logits a decoder layer's router returns (its first output) while the layer runs."""

    def __init__(self, router: nn.Module):
        self.logits: torch.Tensor | None = None
        router.register_forward_hook(self._keep)

    def _keep(self, _module, _inputs, output):
        self.logits = output[0] if isinstance(output, tuple) else output

    def take(self) -> torch.Tensor:
        logits, self.logits = self.logits, None
        if logits is None:
            raise RuntimeError("the decoder layer ran without calling its router")
        return logits
