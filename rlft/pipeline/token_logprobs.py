"""Per-token log-probs (and entropies) of the observed next tokens, over the vocabulary in chunks.

The plain way, ``log_softmax(hidden @ W.T)`` then a gather, keeps an fp32 ``[B, T, V]`` tensor for
the backward pass: for a 152k-token vocabulary that is 0.6 MB per token, 16 GiB for 64 sequences of
450 tokens, more than the model's own activations, and it caps the micro-batch.  Here the logits
are formed ``chunk_tokens`` tokens at a time; forward keeps only each token's log-sum-exp, and
backward forms each chunk's logits again (one more ``[chunk, H] x [H, V]`` product) to get
``d logp / d logits = onehot(target) - softmax``.  Values and gradients are those of the plain way
(the logits are computed in the model's dtype and reduced in fp32 by both); peak memory holds one
chunk of the vocabulary instead of the whole batch.  It costs one more product, so micro-batches
small enough for the plain way (``PLAIN_MAX_ELEMENTS``) keep it; measured on CPU:
benchmarks/results/cpu_2026-12-01_logprobs/.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Elements of one chunk's fp32 logits (256 MiB): 441 tokens of a 152k vocabulary.
CHUNK_ELEMENTS = 1 << 26
# Up to this many logits (4 GiB in fp32) the plain way runs: it is faster (one product fewer) and
# its memory is still small next to the model's.  Beyond it, chunks.
PLAIN_MAX_ELEMENTS = 1 << 30


def default_chunk_tokens(vocab_size: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, vocab_size))


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """``(hidden [N, H], weight [V, H], targets [N])`` -> ``(logp [N], entropy [N])``, fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, with_entropy: bool):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            logits = (hidden[rows] @ weight.t()).float()  # model dtype product, fp32 reduction
            lse[rows] = torch.logsumexp(logits, dim=-1)
            logp[rows] = logits.gather(-1, targets[rows, None]).squeeze(-1) - lse[rows]
            if with_entropy:  # H = lse - sum(p * logits)
                entropy[rows] = lse[rows] - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        chunk = ctx.chunk
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, min(start + chunk, hidden.shape[0]))
            g = grad_logp[rows].float()
            probs = torch.exp((hidden[rows] @ weight.t()).float() - lse[rows, None])
            grad_logits = probs.mul_(-g[:, None])  # d logp_t / d logits = onehot(t) - softmax
            grad_logits.scatter_add_(-1, targets[rows, None], g[:, None])
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:  # each chunk's product summed in fp32
                if hidden.dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.t(), hidden[rows])
                else:  # the product in the model dtype (as the plain way rounds it), then summed
                    grad_weight.add_(grad_logits.t() @ hidden[rows])
        return grad_hidden, (None if grad_weight is None else grad_weight.to(weight.dtype)), None, None, None


def plain_next_token_logprobs(hidden, weight, input_ids, compute_entropy: bool) -> tuple[torch.Tensor, ...]:
    """The whole vocabulary at once: ``log_softmax`` over ``[B,T-1,V]`` in fp32, then a gather."""
    logits = F.linear(hidden[:, :-1], weight)  # [B,T-1,V] in the model dtype; never kept
    # log_softmax upcasts internally and is the only fp32 [B,T-1,V] tensor autograd keeps.
    logp_all = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    del logits
    logp = logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    if not compute_entropy:
        return (logp,)
    with torch.no_grad():
        # Row by row, so the temporary p*log p is [T-1,V] rather than another [B,T-1,V].
        entropy = torch.stack([-(row.exp() * row).sum(-1) for row in logp_all])
    return logp, entropy


def next_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor,
                        compute_entropy: bool, chunk_tokens: int | None = None) -> tuple[torch.Tensor, ...]:
    """Log-probs of the observed next tokens, and optionally the entropy, from final hidden states.

    Args:
        hidden: ``[B,T,H]`` final-norm output.
        weight: ``[V,H]`` output projection (lm_head or tied embedding).
        input_ids: ``[B,T]`` long.
        chunk_tokens: tokens per vocabulary chunk.  Default: the plain way up to
            ``PLAIN_MAX_ELEMENTS`` logits, chunks of 256 MiB of fp32 logits beyond.
    Returns:
        ``(logp,)`` or ``(logp, entropy)``, each ``[B,T-1]`` fp32; entropy is detached.
    """
    b, t, h = hidden.shape
    if chunk_tokens is None and b * (t - 1) * weight.shape[0] <= PLAIN_MAX_ELEMENTS:
        return plain_next_token_logprobs(hidden, weight, input_ids, compute_entropy)
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    flat = hidden[:, :-1].reshape(b * (t - 1), h)
    targets = input_ids[:, 1:].reshape(-1)
    logp, entropy = _ChunkedTokenLogprobs.apply(flat, weight, targets, chunk, compute_entropy)
    logp = logp.view(b, t - 1)
    return (logp, entropy.view(b, t - 1)) if compute_entropy else (logp,)
