"""The policy's optimizer never leaves the weights in a state that is not sane.

`GuardedAdamW.step()` (what DeepSpeed calls once per rank and step) first skips an update whose
gradients are not finite (NaN or inf): the gradients are zeroed instead and `skipped` counts it.
It then takes the step and rolls it back (weights and optimizer state as they were, `rolled_back`
counts it) when the result is not sane: a weight is not finite, or the parameter norm grew by more
than `divergence_factor` in one step.  A learning rate of 1e30 with a finite gradient is caught so.
(The update's norm is no measure of sanity under Adam: while gradients are below its eps the
updates are tiny, and the first ordinary gradient after them makes an update hundreds of times
larger, soundly.)  Both checks span every policy rank (all-reduces over the policy world, whose
default group DeepSpeed's pipeline owns), so all stages and replicas skip, step or roll back
together.  DeepSpeed's ZeRO optimizer skips non-finite steps itself in fp32 but not in bf16, where
NaN would otherwise reach the weights.  `divergence_factor=0` turns the rollback (and the copy of
the weights and optimizer state it keeps during a step) off.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

def _all_reduce(t: torch.Tensor, op) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=op)
    return t


def _squared_norm(tensors: list[torch.Tensor], device) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([n.double() for n in torch._foreach_norm(tensors)]).square().sum()


class SkipNonFiniteSteps:
    """Optimizer mixin: skip non-finite gradients, roll back updates that are not sane (above)."""

    def __init__(self, *args, divergence_factor: float = 10.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.skipped = 0
        self.rolled_back = 0
        self.divergence_factor = divergence_factor
        self.last_rollback: str = ""  # why the last update was rolled back, in words

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _device(self, params):
        return params[0].device if params else torch.device("cpu")

    def grads_finite(self) -> bool:
        params = self._params()
        grads = [p.grad for p in params if p.grad is not None]
        bad = torch.zeros((), dtype=torch.float32, device=self._device(params))
        if grads:
            norms = torch.stack([n.float() for n in torch._foreach_norm(grads)])
            bad = (~torch.isfinite(norms)).any().float()
        return _all_reduce(bad, dist.ReduceOp.MAX).item() == 0

    def _zero_grads(self) -> None:
        for p in self._params():
            if p.grad is not None:
                p.grad.zero_()

    def step(self, closure=None):
        if not self.grads_finite():
            self.skipped += 1
            self._zero_grads()
            return None
        if not self.divergence_factor:
            return super().step(closure)
        params = self._params()
        before = [p.detach().clone() for p in params]
        state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                 for p, s in self.state.items()}
        result = super().step(closure)
        device = self._device(params)
        norms = torch.stack([_squared_norm(before, device), _squared_norm([p.detach() for p in params], device)])
        old, new = (math.sqrt(x) if x >= 0 else float("nan") for x in _all_reduce(norms, dist.ReduceOp.SUM).tolist())
        why = self._insane(old, new)
        if why:
            with torch.no_grad():
                for p, b in zip(params, before):
                    p.copy_(b)
            self.state.clear()
            self.state.update(state)
            self._zero_grads()
            self.rolled_back += 1
            self.last_rollback = why
            return None
        return result

    def _insane(self, old: float, new: float) -> str:
        """Why an update from parameter norm `old` to `new` is not sane ("" if it is)."""
        if not math.isfinite(new):
            return "the weights were not finite"
        if old > 0 and new > self.divergence_factor * old:
            return f"the parameter norm grew from {old:.3g} to {new:.3g}"
        return ""


class GuardedAdamW(SkipNonFiniteSteps, torch.optim.AdamW):
    """AdamW whose updates are skipped or rolled back when not sane (`SkipNonFiniteSteps`)."""
