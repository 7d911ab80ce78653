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

``fused=True`` (with `model.compile_layers`) runs each chunk's element-wise work as ``torch.compile``
kernels: forward reads the chunk's logits once for log-sum-exp, log-prob and entropy, backward once
to write ``d logp / d logits`` in the model's dtype, where the eager chunk casts to fp32, takes
``exp``, multiplies, scatters and casts back in separate passes (on an H200 these passes and the
chunks' weight-gradient sums were a quarter of an SFT step's GPU time).  With no fp32 copy of a
chunk's logits to hold, its chunks are four times larger in bf16 (``FUSED_CHUNK_BYTES``), and four
times fewer ``[V, H]`` weight-gradient sums follow.

A family whose logits are transformed before the softmax (``logit_transform=(divisor, softcap)``:
Granite divides them by ``logits_scaling``, Gemma 2 caps them at ``cap * tanh(logits / cap)``) gets the
transform on each chunk's logits in the model's dtype, as HF applies it, and its derivative in backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Elements of one chunk's fp32 logits (256 MiB): 441 tokens of a 152k vocabulary.
CHUNK_ELEMENTS = 1 << 26
# A fused chunk holds its logits and their gradient in the model's dtype, 512 MiB each: 1766 tokens
# of a 152k vocabulary in bf16, 883 in fp32.
FUSED_CHUNK_BYTES = 1 << 29
# Up to this many logits (4 GiB in fp32) the plain way runs: it is faster (one product fewer) and
# its memory is still small next to the model's.  Beyond it, chunks.
PLAIN_MAX_ELEMENTS = 1 << 30


def default_chunk_tokens(vocab_size: int, fused: bool = False, itemsize: int = 2) -> int:
    """Tokens per chunk: 256 MiB of fp32 logits, or fused, 512 MiB of logits of ``itemsize`` bytes."""
    elements = FUSED_CHUNK_BYTES // itemsize if fused else CHUNK_ELEMENTS
    return max(1, elements // max(1, vocab_size))


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
    """One chunk's ``(logp, lse, entropy)`` from its ``[n, V]`` logits, reduced in fp32 (entropy:
    ``H = lse - sum(p * logits)``)."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    logp = x.gather(-1, targets[:, None]).squeeze(-1) - lse
    entropy = lse - (torch.exp(x - lse[:, None]) * x).sum(-1) if with_entropy else lse.new_empty(0)
    return logp, lse, entropy


def _chunk_grad_logits(logits: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, targets: torch.Tensor):
    """``g * (onehot(target) - softmax)`` for one chunk, in the logits' dtype."""
    p = torch.exp(logits.float() - lse[:, None])
    hit = torch.arange(logits.shape[-1], device=logits.device)[None, :] == targets[:, None]
    return ((hit.float() - p) * g[:, None]).to(logits.dtype)


def transform_logits(logits: torch.Tensor, transform: tuple[float | None, float | None] | None) -> torch.Tensor:
    """``logits / divisor``, then ``softcap * tanh(logits / softcap)``, each where set (HF's order and dtype)."""
    if transform is None:
        return logits
    divisor, softcap = transform
    if divisor is not None:
        logits = logits / divisor
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _untransform_grad(grad: torch.Tensor, transformed: torch.Tensor, transform) -> torch.Tensor:
    """``d loss / d raw logits`` from ``d loss / d transformed logits`` (chain rule of :func:`transform_logits`)."""
    if transform is None:
        return grad
    divisor, softcap = transform
    scale = torch.ones_like(transformed, dtype=torch.float32)
    if softcap is not None:
        scale = 1.0 - (transformed.float() / softcap) ** 2  # tanh' = 1 - tanh^2
    if divisor is not None:
        scale = scale / divisor
    return (grad.float() * scale).to(grad.dtype)


_COMPILED: dict[str, object] = {}


def _compiled(fn):
    """``fn`` compiled once per process (sizes dynamic: the last chunk is shorter)."""
    if fn.__name__ not in _COMPILED:
        _COMPILED[fn.__name__] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn.__name__]


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """``(hidden [N, H], weight [V, H], targets [N])`` -> ``(logp [N], entropy [N])``, fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, with_entropy: bool, fused: bool = False, transform=None):
        ctx.chunk, ctx.fused, ctx.transform = chunk, fused, transform
        stats = _compiled(_chunk_stats) if fused else _chunk_stats
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            # the product in the model's dtype, its reductions in fp32
            logits = transform_logits(hidden[rows] @ weight.t(), transform)
            logp[rows], lse[rows], chunk_entropy = stats(logits, targets[rows], with_entropy)
            if with_entropy:
                entropy[rows] = chunk_entropy
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        chunk = ctx.chunk
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        grad_of = _compiled(_chunk_grad_logits) if ctx.fused else None
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, min(start + chunk, hidden.shape[0]))
            g = grad_logp[rows].float()
            logits = transform_logits(hidden[rows] @ weight.t(), ctx.transform)
            if grad_of is not None:
                grad_logits = grad_of(logits, lse[rows], g, targets[rows])
            else:
                probs = torch.exp(logits.float() - lse[rows, None])
                grad_logits = probs.mul_(-g[:, None])  # d logp_t / d logits = onehot(t) - softmax
                grad_logits.scatter_add_(-1, targets[rows, None], g[:, None])
                grad_logits = grad_logits.to(hidden.dtype)
            grad_logits = _untransform_grad(grad_logits, logits, ctx.transform)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:  # each chunk's product summed in fp32
                if hidden.dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.t(), hidden[rows])
                else:  # the product in the model dtype (as the plain way rounds it), then summed
                    grad_weight.add_(grad_logits.t() @ hidden[rows])
        return (grad_hidden, (None if grad_weight is None else grad_weight.to(weight.dtype)),
                None, None, None, None, None)


def plain_next_token_logprobs(hidden, weight, input_ids, compute_entropy: bool,
                              logit_transform=None) -> tuple[torch.Tensor, ...]:
    """The whole vocabulary at once: ``log_softmax`` over ``[B,T-1,V]`` in fp32, then a gather."""
    logits = transform_logits(F.linear(hidden[:, :-1], weight), logit_transform)  # model dtype; never kept
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
                        compute_entropy: bool, chunk_tokens: int | None = None,
                        fused: bool = False, logit_transform=None) -> tuple[torch.Tensor, ...]:
    """Log-probs of the observed next tokens, and optionally the entropy, from final hidden states.

    Args:
        hidden: ``[B,T,H]`` final-norm output.
        weight: ``[V,H]`` output projection (lm_head or tied embedding).
        input_ids: ``[B,T]`` long.
        chunk_tokens: tokens per vocabulary chunk.  Default: the plain way up to
            ``PLAIN_MAX_ELEMENTS`` logits, chunks of 256 MiB of fp32 logits beyond (fused: 512 MiB
            of logits in the model's dtype).
        fused: each chunk's element-wise work compiled (see the module's docstring).
        logit_transform: ``(divisor, softcap)`` applied to the logits, each None where unset (the
            model family's, :meth:`rlft.models.families.ModelFamily.logit_transform`); None: none.
    Returns:
        ``(logp,)`` or ``(logp, entropy)``, each ``[B,T-1]`` fp32; entropy is detached.
    """
    b, t, h = hidden.shape
    if logit_transform is not None and tuple(logit_transform) == (None, None):
        logit_transform = None
    if chunk_tokens is None and b * (t - 1) * weight.shape[0] <= PLAIN_MAX_ELEMENTS:
        return plain_next_token_logprobs(hidden, weight, input_ids, compute_entropy, logit_transform)
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0], fused, weight.element_size())
    flat = hidden[:, :-1].reshape(b * (t - 1), h)
    targets = input_ids[:, 1:].reshape(-1)
    logp, entropy = _ChunkedTokenLogprobs.apply(flat, weight, targets, chunk, compute_entropy, fused, logit_transform)
    logp = logp.view(b, t - 1)
    return (logp, entropy.view(b, t - 1)) if compute_entropy else (logp,)
