"""HF ``generate`` rollout engine: vLLM's sampling semantics on a tiny Llama.

Most tests use a "chain" model whose greedy (and, at temperature 1, near-certain) next token
is fixed by construction, so the expected completions are known by hand:
attention and MLP outputs are zeroed, so the last hidden state is the normalised embedding
``h(a)`` of the current token ``a``, and ``lm_head`` row ``next(a)`` is ``ALPHA * h(a)/|h(a)|``.
The winning logit is then ``ALPHA * sqrt(hidden)`` (~34) while every other logit is a few
units at most.

The helpers here are also used by ``test_engines_vllm.py``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rlft.engines import (
    EngineUnavailable,
    SamplingSpec,
    make_engine,
    named_weights_checksum,
    restrict_to_device,
)
from rlft.engines.hf_engine import HFEngine, VLLMStyleLogitsProcessor, find_stop

TAGS = ["<think>", "</think>", "<answer>", "</answer>", ">ok"]
ALPHA = 3.0
VOCAB = 320  # a multiple of 64, so vLLM does not pad the embedding


# ----------------------------------------------------------------------------- helpers
def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer without merges (every byte is a token) plus the answer tags as
    single tokens, and ``>ok``: a token that completes ``</answer>`` and runs past it."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True), AddedToken("<|pad|>", special=True)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


def tiny_config(tokenizer, *, tie: bool = False) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,  # GQA: vLLM fuses q/k/v of different sizes
        head_dim=64,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def random_model(tokenizer, seed: int, *, std: float = 0.3, tie: bool = False) -> LlamaForCausalLM:
    """Random weights, wide enough (std 0.3) that greedy choices are far from ties."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(tokenizer, tie=tie))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, std)
    return model.eval()


def chain_transitions(tokenizer) -> tuple[dict[int, int], dict[int, int]]:
    """``next`` and ``second choice`` maps (token id -> token id) of the chain model."""
    ids = tokenizer.convert_tokens_to_ids
    eos = tokenizer.eos_token_id
    step = {}

    def cycle(tokens):
        for a, b in zip(tokens, tokens[1:]):
            step[ids(a)] = ids(b) if isinstance(b, str) else b

    cycle(["<answer>", "4", "2", "</answer>", "<answer>"])  # tag stop string, loops
    cycle(["#", "<", "/", "a", "n", "s", "w", "e", "r", ">ok", "#"])  # "</answer>" spelled in bytes
    cycle(["E", "x", eos])  # eos after one token ...
    step[ids("y")] = eos
    second = {ids("x"): ids("y")}  # ... or x, y, eos while eos is masked by min_tokens
    return step, second


def chain_model(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(tokenizer))
    step, second = chain_transitions(tokenizer)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_(0.0, 1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        unit = torch.nn.functional.normalize(emb, dim=-1)  # direction of h(a) = e_a / rms(e_a)
        head = torch.zeros_like(model.lm_head.weight)
        for a, b in step.items():
            head[b] += ALPHA * unit[a]
        for a, b in second.items():
            head[b] += 0.5 * ALPHA * unit[a]
        model.lm_head.weight.copy_(head)
    return model.eval()


def save_model(model, tokenizer, directory: Path) -> str:
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def tokens(tokenizer, pieces: list) -> list[int]:
    return [p if isinstance(p, int) else tokenizer.convert_tokens_to_ids(p) for p in pieces]


@torch.no_grad()
def model_token_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The model's own log-probs of ``response`` after ``prompt``: ``log_softmax`` of its raw logits
    (temperature 1, nothing else applied), one unpadded forward pass, the trainer's definition."""
    full = torch.tensor([prompt + response])
    logits = model(input_ids=full).logits[0, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(1, full[0, 1:, None]).squeeze(1)
    return logp[len(prompt) - 1:]


# The chain cases shared with the vLLM tests: (prompt text, spec kwargs, expected pieces,
# expected text, finish reason). "<eos>" stands for the eos id.
def chain_cases(tokenizer):
    eos = tokenizer.eos_token_id
    return [
        ("Q <answer>", dict(min_tokens=0), ["4", "2", "</answer>"], "42</answer>", "stop"),
        ("Q <answer>", dict(min_tokens=2), ["4", "2", "</answer>"], "42</answer>", "stop"),
        # </answer> as token 3 does not count with min_tokens=3: the next one (token 7) does.
        (
            "Q <answer>",
            dict(min_tokens=3),
            ["4", "2", "</answer>", "<answer>", "4", "2", "</answer>"],
            "42</answer><answer>42</answer>",
            "stop",
        ),
        ("Q <answer>", dict(min_tokens=0, include_stop_str_in_output=False), ["4", "2", "</answer>"], "42", "stop"),
        ("Q <answer>", dict(min_tokens=0, max_tokens=2), ["4", "2"], "42", "length"),
        ("Q <answer>", dict(min_tokens=0, stop=[], max_tokens=6), ["4", "2", "</answer>", "<answer>", "4", "2"], "42</answer><answer>42", "length"),
        # The stop string completes inside ">ok": the token is kept, the text is cut.
        ("Q #", dict(min_tokens=0), ["<", "/", "a", "n", "s", "w", "e", "r", ">ok"], "</answer>", "stop"),
        ("Q #", dict(min_tokens=0, include_stop_str_in_output=False), ["<", "/", "a", "n", "s", "w", "e", "r", ">ok"], "", "stop"),
        # eos is kept as the last token id and is not part of the text.
        ("Q E", dict(min_tokens=0), ["x", eos], "x", "eos"),
        # min_tokens=2 masks eos for tokens 1 and 2: the runner-up y comes second.
        ("Q E", dict(min_tokens=2), ["x", "y", eos], "xy", "eos"),
    ]


# ----------------------------------------------------------------------------- fixtures
def rollout_worker(engine, tokenizer, **grpo):
    """The rollout role's sampling half over `engine`: two prompts per step, two responses each, of at
    most 6 tokens (no data set, no grader)."""
    from rlft.config import build_config
    from rlft.roles.rollout import RolloutWorker
    cfg = build_config({"grpo": {"group_size": 2, **grpo}, "optim": {"rollout_batch_size": 4},
                        "data": {"prompt_template": "r1_short"},
                        "sampling": {"max_tokens": 6, "min_tokens": 0, "temperature": 1.0}})
    from rlft.roles.generation import RolloutGenerator
    w = RolloutWorker.__new__(RolloutWorker)
    w.cfg, w.engine, w.tokenizer, w.group_size = cfg, engine, tokenizer, 2
    w.generator = RolloutGenerator(cfg, engine, tokenizer)
    return w


def rollout_examples():
    from rlft.data import Example
    return [Example(question=q, ground_truth="7", solution=None, source="test", index=i)
            for i, q in enumerate(["3+4?", "2+5?"])]


def check_logprobs_only_where_read(engine, tokenizer):
    """Default GRPO: step 2 samples without log-probs (none reach the batch); step 1 (the mismatch
    metrics' step) and any step with TIS or an off-policy schedule sample with them."""
    default = rollout_worker(engine, tokenizer)
    assert [s for s in range(1, 13) if default.wants_logprobs(s)] == [1, 11]
    plain = default.generator.generate(rollout_examples(), seed=5, logprobs=default.wants_logprobs(2))
    assert len(plain) == 4 and [row.logprobs for row in plain] == [None] * 4
    grades = [{"reward": float(i % 2), "format_reward": 0.0, "answer_reward": 0.0} for i in range(4)]
    assert default.to_batch(plain, grades)[0].sampler_logprobs is None
    for worker, step in ((default, 1), (rollout_worker(engine, tokenizer, rollout_is="tis"), 2)):
        assert worker.wants_logprobs(step)
        measured = worker.generator.generate(rollout_examples(), seed=5, logprobs=True)
        assert [len(row.logprobs) for row in measured] == [len(row.response_ids) for row in measured]
        assert all(math.isfinite(x) and x <= 0 for row in measured for x in row.logprobs)
        batch, _ = worker.to_batch(measured, grades)
        assert batch.sampler_logprobs is not None and batch.sampler_logprobs.sum() < 0


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def chain_engine(tokenizer):
    return HFEngine(chain_model(tokenizer), dtype="float32", tokenizer=tokenizer)


# ----------------------------------------------------------------------------- pure parts
def test_find_stop_cuts_on_token_boundaries():
    pieces = ["ab", "</", "ans", "wer>", "xy", "</answer>"]
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    ids = list(range(len(pieces)))
    # Completed by token 4 ("wer>"): keep 4 tokens; text ends right after the stop string.
    assert find_stop(ids, decode, ["</answer>"], 0, True) == (4, "ab</answer>")
    assert find_stop(ids, decode, ["</answer>"], 0, False) == (4, "ab")
    # min_tokens=4: an occurrence completed within the first 4 tokens does not count.
    assert find_stop(ids, decode, ["</answer>"], 4, True) == (6, "ab</answer>xy</answer>")
    assert find_stop(ids, decode, ["</answer>"], 3, True) == (4, "ab</answer>")
    # A stop string cut mid-token: "r>x" ends inside "wer>" + "xy" -> token 5, text cut after "x".
    assert find_stop(ids, decode, ["r>x"], 0, True) == (5, "ab</answer>x")
    # The earliest-ending of several stop strings wins.
    assert find_stop(ids, decode, ["xy", "ans"], 0, True) == (3, "ab</ans")
    assert find_stop(ids, decode, ["zz"], 0, True) is None
    assert find_stop(ids, decode, [], 0, True) is None


def test_logits_processor_penalty_ignores_left_padding_and_top_p_by_hand():
    pad = 9
    input_ids = torch.tensor([[pad, pad, 1, 3], [0, 1, 2, 2]])
    scores = torch.tensor([[2.0, -1.0, 0.5, 4.0, 1.0, 0.0, 0.0, 0.0, 0.0, 3.0]] * 2)
    out = VLLMStyleLogitsProcessor(torch.tensor([2, 0]), 2.0, None, 1.0)(input_ids, scores.clone())
    # Row 0 saw tokens 1 and 3 (not the pad 9): -1 -> -2, 4 -> 2.
    assert out[0].tolist() == [2.0, -2.0, 0.5, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 3.0]
    # Row 1 saw 0, 1, 2 (2 twice still counts once): 2 -> 1, -1 -> -2, 0.5 -> 0.25.
    assert out[1].tolist() == [1.0, -2.0, 0.25, 4.0, 1.0, 0.0, 0.0, 0.0, 0.0, 3.0]

    # top_p 0.8 over probabilities (0.5, 0.3, 0.15, 0.05): ascending cumulative sums are
    # 0.05, 0.2, 0.5, 1.0; those <= 1 - 0.8 (0.05, 0.15) are dropped.
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    out = VLLMStyleLogitsProcessor(torch.tensor([0]), 1.0, 1.0, 0.8)(torch.tensor([[0]]), probs.log())
    assert torch.isinf(out[0, [0, 2]]).all()
    assert torch.allclose(out[0, [1, 3]], probs[0, [1, 3]].log())
    # temperature 0.5 doubles the logits.
    out = VLLMStyleLogitsProcessor(torch.tensor([0]), 1.0, 0.5, 1.0)(torch.tensor([[0]]), torch.tensor([[1.0, -3.0]]))
    assert out.tolist() == [[2.0, -6.0]]


def test_sampling_spec_validation_names_the_field():
    with pytest.raises(ValueError, match="top_p"):
        SamplingSpec(top_p=0.0).validate()
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingSpec(min_tokens=10, max_tokens=5).validate()
    with pytest.raises(ValueError, match="stop"):
        SamplingSpec(stop="</answer>").validate()


# ----------------------------------------------------------------------------- generation
@pytest.mark.parametrize("case", range(10))
def test_chain_cases_greedy(chain_engine, tokenizer, case):
    prompt, kwargs, pieces, text, reason = chain_cases(tokenizer)[case]
    spec = SamplingSpec(temperature=0.0, **{"max_tokens": 16, **kwargs})
    [[completion]] = chain_engine.generate([encode(tokenizer, prompt)], spec)
    assert completion.token_ids == tokens(tokenizer, pieces)
    assert completion.text == text
    assert completion.finish_reason == reason


def test_n_sampled_completions_per_prompt_stop_at_answer(chain_engine, tokenizer):
    """At temperature 1 the chain is still near-certain (winning logit ~34 vs ~3)."""
    prompts = [encode(tokenizer, "Q <answer>"), encode(tokenizer, "a longer prompt #")]
    spec = SamplingSpec(temperature=1.0, top_p=0.9, n=3, min_tokens=0, max_tokens=16, seed=5)
    out = chain_engine.generate(prompts, spec)
    assert [len(group) for group in out] == [3, 3]
    for c in out[0]:
        assert (c.token_ids, c.text, c.finish_reason) == (tokens(tokenizer, ["4", "2", "</answer>"]), "42</answer>", "stop")
    for c in out[1]:
        assert c.text == "</answer>" and c.token_ids[-1] == tokenizer.convert_tokens_to_ids(">ok")


def test_greedy_is_deterministic_and_independent_of_batching(tokenizer):
    engine = HFEngine(random_model(tokenizer, seed=1), dtype="float32", tokenizer=tokenizer, max_batch_sequences=8)
    prompts = [encode(tokenizer, "Hello"), encode(tokenizer, "a much longer prompt, padded less"), [3]]
    spec = SamplingSpec(temperature=0.0, max_tokens=10, min_tokens=10, stop=[], repetition_penalty=1.1)
    batched = engine.generate(prompts, spec)
    assert engine.generate(prompts, spec) == batched
    one_by_one = [engine.generate([p], spec)[0] for p in prompts]
    assert [g[0].token_ids for g in one_by_one] == [g[0].token_ids for g in batched]
    assert all(len(g[0].token_ids) == 10 and g[0].finish_reason == "length" for g in batched)
    # The penalty changes the greedy path (else the repetition-penalty tests prove nothing).
    plain = engine.generate(prompts, SamplingSpec(temperature=0.0, max_tokens=10, min_tokens=10, stop=[], repetition_penalty=1.0))
    assert [g[0].token_ids for g in plain] != [g[0].token_ids for g in batched]


def test_seeded_sampling_is_reproducible_and_samples_differ(tokenizer):
    engine = HFEngine(random_model(tokenizer, seed=2, std=0.05), dtype="float32", tokenizer=tokenizer)
    prompts = [encode(tokenizer, "Hi"), encode(tokenizer, "there")]
    spec = SamplingSpec(temperature=1.0, n=4, max_tokens=8, min_tokens=8, stop=[], seed=123)
    first = engine.generate(prompts, spec)
    assert engine.generate(prompts, spec) == first
    assert len({tuple(c.token_ids) for c in first[0]}) == 4  # near-uniform over 320 tokens
    other = engine.generate(prompts, SamplingSpec(temperature=1.0, n=4, max_tokens=8, min_tokens=8, stop=[], seed=124))
    assert other != first
    # Unseeded calls draw fresh samples from the engine's own (seeded) stream.
    unseeded = SamplingSpec(temperature=1.0, n=1, max_tokens=8, min_tokens=8, stop=[])
    assert engine.generate(prompts, unseeded) != engine.generate(prompts, unseeded)


def test_completions_carry_the_raw_logprobs_of_their_tokens(tokenizer):
    """Each token's log-prob is the model's own (raw logits, temperature 1), whatever the sampling
    settings: penalty, temperature, top-p and min_tokens shape what is drawn, not what is reported."""
    model = random_model(tokenizer, seed=3, std=0.05)
    engine = HFEngine(model, dtype="float32", tokenizer=tokenizer)
    prompts = [encode(tokenizer, "Hi"), encode(tokenizer, "a longer prompt, left-padded less")]
    spec = SamplingSpec(temperature=0.7, top_p=0.9, repetition_penalty=1.3, min_tokens=3, max_tokens=8, stop=[],
                        n=2, seed=4)
    out = engine.generate(prompts, spec)
    for prompt, group in zip(prompts, out):
        for c in group:
            assert len(c.logprobs) == len(c.token_ids) == 8
            want = model_token_logprobs(model, prompt, c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=2e-5, rtol=0)
            # Not the processed distribution's: temperature 0.7 alone would sharpen every log-prob.
            assert not torch.allclose(torch.tensor(c.logprobs), torch.log_softmax(
                model(input_ids=torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1] / 0.7, -1
            ).gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1), atol=1e-3)
    # Asked not to, the engine returns none.
    [[c]] = engine.generate(prompts[:1], SamplingSpec(max_tokens=4, stop=[], seed=1, logprobs=False))
    assert c.logprobs is None


@pytest.mark.parametrize("case", [0, 2, 4, 8, 9])
def test_chain_logprobs_include_eos_masked_by_min_tokens(chain_engine, tokenizer, case):
    """Greedy chain completions: near-certain tokens (log-prob ~0), and in case 9 the runner-up "y"
    that min_tokens forced (its raw log-prob is far below 0, as eos was the model's choice)."""
    prompt, kwargs, pieces, _, _ = chain_cases(tokenizer)[case]
    ids = encode(tokenizer, prompt)
    [[c]] = chain_engine.generate([ids], SamplingSpec(temperature=0.0, **{"max_tokens": 16, **kwargs}))
    want = model_token_logprobs(chain_engine.model, ids, c.token_ids)
    torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=2e-5, rtol=0)
    if case == 9:
        assert c.logprobs[1] < -5 and c.logprobs[0] > -1e-3 and c.logprobs[2] > -1e-3


# ----------------------------------------------------------------------------- weights
def test_checksums_are_float64_sums_worked_by_hand():
    """Exact binary fractions in fp32 and bf16, so float64 sums in any order give these values; a
    tied lm_head counts once, and a cast first (fp32 trainer weights against a bf16 engine) rounds."""
    from rlft.engines import weights_checksum_of

    a = torch.tensor([1.5, -2.25], dtype=torch.float32)
    b = torch.tensor([[0.5, -0.125], [4.0, 0.0]], dtype=torch.bfloat16)
    assert weights_checksum_of([a, b]) == {"sum": 3.625, "abs_sum": 8.375}
    assert weights_checksum_of([]) == {"sum": 0.0, "abs_sum": 0.0}
    named = [("model.embed_tokens.weight", b), ("lm_head.weight", b), ("model.norm.weight", a)]
    assert named_weights_checksum(named, tie_word_embeddings=True) == {"sum": 3.625, "abs_sum": 8.375}
    assert named_weights_checksum(named) == {"sum": 8.0, "abs_sum": 13.0}
    # 1 + 2**-10 is not a bf16 number: it rounds to 1
    assert named_weights_checksum([("w", torch.tensor([1 + 2**-10]))], dtype=torch.bfloat16)["sum"] == 1.0


def test_16bit_checksums_sum_float32_blocks_without_a_float64_copy():
    """bf16 weights are summed in float32 blocks, then the block sums in float64: within 1e-9 of the
    exact float64 sums, identical for a fused layout of the same tensors (vLLM's qkv_proj), within
    1e-9 for a transposed one; and no float64 copy of a tensor is made (a
    float64 sum of a bf16 tensor would first cast all of it: 8 bytes an element)."""
    from rlft.engines import weights_checksum_of

    torch.manual_seed(0)
    q, k, v = ((torch.randn(rows, 1536) * 0.02).bfloat16() for rows in (1536, 256, 256))
    norm = (1 + torch.randn(1536) * 0.1).bfloat16()
    odd = torch.randn(7, 3).bfloat16()  # 21 elements: blocks of one
    weights = [q, k, v, norm, odd]
    exact = {"sum": sum(t.double().sum().item() for t in weights),
             "abs_sum": sum(t.double().abs().sum().item() for t in weights)}

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        got = weights_checksum_of(weights)
    # On a CPU torch sums bf16 into float32 through a float32 copy (4 bytes an element; a GPU reads
    # bf16 as it is); the float64 cast made 8
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest <= 4 * q.numel()
    scale = exact["abs_sum"]
    for key in got:
        assert abs(got[key] - exact[key]) <= 1e-9 * scale, (key, got[key], exact[key])
    assert weights_checksum_of([torch.cat([q, k, v]), norm, odd]) == got
    transposed = weights_checksum_of([q.t().contiguous(), k, v, norm, odd])
    assert all(abs(transposed[key] - got[key]) <= 1e-9 * scale for key in got)
    assert weights_checksum_of([q, k, v, -norm, odd])["sum"] < got["sum"] - 1000


def test_update_weights_changes_outputs_and_matches_source_checksum(tokenizer):
    source = random_model(tokenizer, seed=3)
    target = random_model(tokenizer, seed=4)
    engine = HFEngine(source, dtype="float32", tokenizer=tokenizer)
    assert engine.weights_checksum() == named_weights_checksum(random_model(tokenizer, seed=3).state_dict().items())
    prompts = [encode(tokenizer, "Q: 1+1?"), encode(tokenizer, "x")]
    spec = SamplingSpec(temperature=0.0, max_tokens=8, min_tokens=8, stop=[])
    before = engine.generate(prompts, spec)

    engine.update_weights((name, t.clone()) for name, t in target.state_dict().items())  # a stream
    expected = named_weights_checksum(target.state_dict().items())
    assert engine.weights_checksum() == expected
    after = engine.generate(prompts, spec)
    assert after != before
    reference = HFEngine(random_model(tokenizer, seed=4), dtype="float32", tokenizer=tokenizer)
    assert after == reference.generate(prompts, spec)


def test_update_weights_tied_embeddings_and_strict_names(tokenizer):
    engine = HFEngine(random_model(tokenizer, seed=5, tie=True), dtype="float32", tokenizer=tokenizer)
    target = random_model(tokenizer, seed=6, tie=True)
    state = {k: v for k, v in target.state_dict().items() if k != "lm_head.weight"}
    engine.update_weights(state.items())  # lm_head.weight absent: it is the embedding
    assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(engine.model.lm_head.weight, target.model.embed_tokens.weight)
    # Engines count a tied embedding once; the state dict holds it twice.
    assert engine.weights_checksum() == named_weights_checksum(target.state_dict().items(), tie_word_embeddings=True)
    assert engine.weights_checksum() != named_weights_checksum(target.state_dict().items())

    with pytest.raises(ValueError, match="unknown parameter name 'model.layers.9.mlp.up_proj.weight'"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(256, 128))])
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(3,\), expected \(128,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])


# ----------------------------------------------------------------------------- factory
def test_make_engine_hf_from_a_saved_model(tokenizer, tmp_path):
    path = save_model(chain_model(tokenizer), tokenizer, tmp_path / "chain")
    engine = make_engine("hf", path, dtype="float32", device="cpu", seed=0)
    assert isinstance(engine, HFEngine)
    [[c]] = engine.generate([encode(tokenizer, "Q <answer>")], SamplingSpec(temperature=0, min_tokens=0, max_tokens=8))
    assert c.text == "42</answer>"
    with pytest.raises(ValueError, match="unknown rollout backend 'tgi'"):
        make_engine("tgi", path)


@pytest.fixture
def registry():
    """rlft.engines' registry, restored after the test (which registers engines of its own)."""
    from rlft.engines import BACKENDS

    saved = dict(BACKENDS)
    yield BACKENDS
    BACKENDS.clear()
    BACKENDS.update(saved)


def test_a_registered_backend_is_built_chosen_and_described_by_its_record(tokenizer, tmp_path, registry):
    from dataclasses import dataclass

    from rlft.config import load_config
    from rlft.config.topology import roles_for_rank
    from rlft.engines import Backend, backend_choices, candidates, register_backend, resolve_backend
    from rlft.runtime.rank import may_host_gpu_process_engine

    assert backend_choices() == ("auto", *registry) and list(registry)[:2] == ["vllm", "hf"]  # auto tries vLLM first
    assert (registry["vllm"].own_gpu_process, registry["hf"].own_gpu_process) == (True, False)
    assert candidates("auto") == list(registry.values()) and candidates("hf") == [registry["hf"]]
    # A new engine is one record: the config accepts it, make_engine builds it, `auto` tries it in
    # order, and a rank that may build it restricts its GPU when the record says it needs to.
    path = save_model(chain_model(tokenizer), tokenizer, tmp_path / "chain")
    built = []

    @dataclass(frozen=True)
    class GreedyHF(Backend):
        def usable(self, model_path, device):
            return device == "cpu", "CPU only"

        def build(self, model_path, *, options, **common):
            built.append((model_path, options))
            return super().build(model_path, options={}, **common)

    others = dict(registry)
    registry.clear()  # registered first, so that `auto` tries it first
    register_backend(GreedyHF("greedy_hf", engine="rlft.engines.hf_engine:HFEngine", own_gpu_process=True))
    registry.update(others)
    cfg = load_config(None, ["sampling.backend=greedy_hf", "topology.policy_ranks=[0]", "topology.pipeline_stages=1",
                             "topology.sampler_rank=1", "topology.reference_rank=1", "topology.evaluator_rank=1"])
    assert isinstance(make_engine("greedy_hf", path, options={"x": 1}), HFEngine) and built == [(path, {"x": 1})]
    assert resolve_backend("auto", path, "cpu").name == "greedy_hf"
    assert resolve_backend("auto", path, "cuda").name != "greedy_hf"
    assert may_host_gpu_process_engine(cfg, roles_for_rank(cfg.topology, 1))  # sampler and evaluator
    assert not may_host_gpu_process_engine(cfg, roles_for_rank(cfg.topology, 0))  # the policy only
    # A name is registered once; `auto` is not an engine's name.
    register_backend(registry["greedy_hf"])  # the same record again: nothing changes
    with pytest.raises(ValueError, match="'hf' is registered already"):
        register_backend(Backend("hf", engine="elsewhere:Engine"))
    with pytest.raises(ValueError, match="cannot be named 'auto'"):
        register_backend(Backend("auto", engine="elsewhere:Engine"))


def test_vllm_version_check_names_installed_version_and_range(monkeypatch):
    from rlft.engines import vllm_backend

    monkeypatch.setattr(vllm_backend, "installed_vllm_version", lambda: "0.8.5")
    with pytest.raises(EngineUnavailable, match=r"vLLM 0\.8\.5 is installed; rlft supports vllm >=0\.10\.2,<0\.33"):
        vllm_backend.check_vllm()
    monkeypatch.setattr(vllm_backend, "installed_vllm_version", lambda: None)
    with pytest.raises(EngineUnavailable, match="vLLM is not installed"):
        make_engine("vllm", "unused")
    monkeypatch.setattr(vllm_backend, "installed_vllm_version", lambda: "0.33.0rc1")
    with pytest.raises(EngineUnavailable, match="0.33.0rc1"):
        vllm_backend.check_vllm()
    monkeypatch.setattr(vllm_backend, "installed_vllm_version", lambda: "0.32.0+cpu")
    assert vllm_backend.check_vllm() == "0.32.0+cpu"


def test_restrict_to_device(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert restrict_to_device(3) == "3" and os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert restrict_to_device(1) == "5"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    with pytest.raises(ValueError, match="out of range"):
        restrict_to_device(3)


def test_chain_model_logit_margin(tokenizer):
    """The construction the chain tests rely on: next(a) wins by a wide margin."""
    model = chain_model(tokenizer)
    step, _ = chain_transitions(tokenizer)
    with torch.no_grad():
        logits = model(torch.tensor([list(step)])).logits[0]
    top2 = logits.topk(2, dim=-1)
    assert top2.indices[:, 0].tolist() == list(step.values())
    assert (top2.values[:, 0] > ALPHA * math.sqrt(128) * 0.9).all()
    assert (top2.values[:, 0] - top2.values[:, 1] > 10).all()


def test_default_rollouts_ask_the_hf_engine_for_no_logprobs(tokenizer):
    engine = HFEngine(random_model(tokenizer, seed=4, std=0.05), dtype="float32", tokenizer=tokenizer)
    check_logprobs_only_where_read(engine, tokenizer)


class CallRecordingEngine(HFEngine):
    """The HF engine, recording the prompts and sampling of every generate call."""

    calls: list

    def generate(self, prompt_token_ids, spec):
        self.calls.append(([list(p) for p in prompt_token_ids], spec))
        return super().generate(prompt_token_ids, spec)


def test_a_single_turn_rollout_is_one_engine_call_with_n_group_size_whose_completions_are_the_rows(tokenizer):
    """The single-turn environment's episodes cost what plain sampling costs: one call, n = group_size,
    the run's sampling as given; the rows are that call's completions, every token in the response mask."""
    from rlft.engines.base import sampling_spec

    engine = CallRecordingEngine(random_model(tokenizer, seed=4, std=0.05), dtype="float32", tokenizer=tokenizer)
    engine.calls = []
    worker = rollout_worker(engine, tokenizer)
    rows = worker.generator.generate(rollout_examples(), seed=5, logprobs=True)
    [(prompts, spec)] = engine.calls
    assert spec == sampling_spec(worker.cfg.sampling, n=2, seed=5, logprobs=True)
    assert prompts == worker.generator.prompt.encode(["3+4?", "2+5?"], tokenizer)
    direct = [c for group in HFEngine.generate(engine, prompts, spec) for c in group]
    assert [row.response_ids for row in rows] == [list(c.token_ids) for c in direct]
    assert [row.logprobs for row in rows] == [list(c.logprobs) for c in direct]
    assert [(row.text, row.finish_reason) for row in rows] == [(c.text, c.finish_reason) for c in direct]
    assert [row.response_mask for row in rows] == [[1] * len(c.token_ids) for c in direct]
    assert [row.prompt_ids for row in rows] == [prompts[0], prompts[0], prompts[1], prompts[1]]


def test_a_single_turn_environment_of_its_own_gives_the_training_prompts(tokenizer):
    """A registered single-turn environment is played, not passed over: its openings are the prompts the
    engine receives, one call with n = group_size as the built-in one."""
    from rlft.config import build_config
    from rlft.envs.base import EpisodeStart, SingleTurnEnvironment
    from rlft.envs.registry import ENVIRONMENTS, EnvironmentRecord, register_environment
    from rlft.roles.generation import RolloutGenerator

    class Bracketed(SingleTurnEnvironment):
        def open(self, question, ground_truth):
            return EpisodeStart(text=f"[{question}] =")

    register_environment(EnvironmentRecord("_test_bracketed", Bracketed, multi_turn=False))
    try:
        cfg = build_config({"grpo": {"group_size": 2}, "optim": {"rollout_batch_size": 4},
                            "environment": {"name": "_test_bracketed"}, "sampling": {"max_tokens": 4}})
        engine = CallRecordingEngine(random_model(tokenizer, seed=4, std=0.05), dtype="float32", tokenizer=tokenizer)
        engine.calls = []
        rows = RolloutGenerator(cfg, engine, tokenizer).generate(rollout_examples(), seed=5)
    finally:
        del ENVIRONMENTS["_test_bracketed"]
    [(prompts, spec)] = engine.calls
    assert spec.n == 2 and prompts == [tokenizer(t)["input_ids"] for t in ("[3+4?] =", "[2+5?] =")]
    assert [row.prompt for row in rows] == ["[3+4?] ="] * 2 + ["[2+5?] ="] * 2
    assert [row.prompt_ids for row in rows] == [prompts[0]] * 2 + [prompts[1]] * 2
