"""Log-probs over the vocabulary in chunks: the same values, entropies and gradients as the plain
``log_softmax(hidden @ W.T)``, whatever the chunk size."""
import pytest
import torch
import torch.nn.functional as F

from rlft.pipeline.token_logprobs import default_chunk_tokens, next_token_logprobs


def plain(hidden, weight, ids):
    logp_all = torch.log_softmax(F.linear(hidden[:, :-1], weight), dim=-1, dtype=torch.float32)
    return logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


# 3 x 6 = 18 tokens: one chunk, several, ragged; eager chunks, and fused ones (compiled element-wise work)
@pytest.mark.parametrize("chunk,fused,with_entropy", [(1, False, True), (5, False, True), (18, False, True),
                                                      (100, False, True), (5, True, True), (5, True, False),
                                                      (1, True, True)])
def test_values_entropy_and_gradients_equal_the_plain_computation(chunk, fused, with_entropy):
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    ids = torch.randint(0, 50, (3, 7))
    upstream = torch.randn(3, 6)
    want_logp, want_entropy = plain(hidden, weight, ids)
    (want_logp * upstream).sum().backward()
    want_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    out = next_token_logprobs(hidden, weight, ids, compute_entropy=with_entropy, chunk_tokens=chunk, fused=fused)
    (out[0] * upstream).sum().backward()
    assert len(out) == 1 + with_entropy
    logp = out[0]
    assert logp.shape == (3, 6) and logp.dtype == torch.float32
    torch.testing.assert_close(logp, want_logp, atol=2e-6, rtol=1e-6)
    if with_entropy:
        assert out[1].shape == (3, 6) and not out[1].requires_grad
        torch.testing.assert_close(out[1], want_entropy, atol=1e-5, rtol=1e-5)  # two fp32 roundings of H
    torch.testing.assert_close(hidden.grad, want_grads[0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(weight.grad, want_grads[1], atol=2e-6, rtol=1e-5)


def test_a_tied_weight_collects_both_gradients():
    # The tied embedding is both the input table and the output projection: its gradient is the sum.
    torch.manual_seed(1)
    table = torch.randn(30, 8, requires_grad=True)
    ids = torch.randint(0, 30, (2, 5))
    logp, = next_token_logprobs(F.embedding(ids, table) * 2, table, ids, compute_entropy=False, chunk_tokens=3)
    logp.sum().backward()
    got = table.grad.clone()
    table.grad = None
    want, _ = plain(F.embedding(ids, table) * 2, table, ids)
    want.sum().backward()
    torch.testing.assert_close(got, table.grad, atol=2e-6, rtol=1e-5)


def test_bfloat16_stays_within_its_precision():
    torch.manual_seed(2)
    hidden = torch.randn(2, 9, 32, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 64, (2, 9))
    want, _ = plain(hidden, weight, ids)
    want.sum().backward()
    want_w = weight.grad.float().clone()
    weight.grad = None
    logp, = next_token_logprobs(hidden, weight, ids, compute_entropy=False, chunk_tokens=4)
    logp.sum().backward()
    torch.testing.assert_close(logp, want, atol=1e-5, rtol=1e-5)  # the same bf16 logits, fp32 reductions
    assert weight.grad.dtype == torch.bfloat16
    assert (weight.grad.float() - want_w).abs().max() <= 0.01 * want_w.abs().max()


def test_default_chunk_is_256_mib_of_fp32_logits():
    assert default_chunk_tokens(151936) == 441 and default_chunk_tokens(1) == 1 << 26


def test_small_batches_take_the_plain_way_and_large_ones_chunk(monkeypatch):
    import rlft.pipeline.token_logprobs as tl

    calls = []
    monkeypatch.setattr(tl._ChunkedTokenLogprobs, "apply", lambda *a: calls.append(a[3]) or
                        (torch.zeros(a[0].shape[0]), torch.zeros(0)))
    hidden, weight, ids = torch.randn(2, 5, 4), torch.randn(10, 4), torch.randint(0, 10, (2, 5))
    next_token_logprobs(hidden, weight, ids, compute_entropy=False)  # 8 x 10 logits: plain
    assert calls == []
    monkeypatch.setattr(tl, "PLAIN_MAX_ELEMENTS", 79)  # one fewer than 8 x 10
    next_token_logprobs(hidden, weight, ids, compute_entropy=False)
    assert calls == [tl.default_chunk_tokens(10)]


def test_fused_bfloat16_equals_the_eager_chunks():
    """In bf16 the fused chunks take the same bf16 logits and reduce them in fp32 as the eager ones:
    equal log-probs; gradients within a bf16 rounding of each other (``(1 - p) g`` against
    ``-p g + g``)."""
    torch.manual_seed(4)
    hidden = torch.randn(2, 9, 32, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 64, (2, 9))
    grads = []
    for fused in (False, True):
        logp, = next_token_logprobs(hidden, weight, ids, compute_entropy=False, chunk_tokens=4, fused=fused)
        logp.sum().backward()
        grads.append((logp.detach(), hidden.grad.float(), weight.grad.float()))
        hidden.grad = weight.grad = None
    (eager_logp, eager_h, eager_w), (fused_logp, fused_h, fused_w) = grads
    torch.testing.assert_close(fused_logp, eager_logp, atol=1e-6, rtol=1e-6)
    assert (fused_h - eager_h).abs().max() <= 0.01 * eager_h.abs().max()
    assert (fused_w - eager_w).abs().max() <= 0.01 * eager_w.abs().max()


def test_fused_chunks_hold_512_mib_of_logits_in_the_model_dtype():
    assert default_chunk_tokens(151936, fused=True, itemsize=2) == 1766  # bf16: four times 441 (eager)
    assert default_chunk_tokens(151936, fused=True, itemsize=4) == 883
