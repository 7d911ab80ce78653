"""Tests for rlft.pipeline: the policy as a DeepSpeed PipelineModule.

The stage split and the layer maths run in-process. The pipeline itself runs under the real
``deepspeed`` launcher (CPU, gloo) in two launches, 2 and 3 stages, each running several model
configurations (tests/pipeline_check.py); its log-probs, gradients and weight exports are compared
here with the plain HF model holding the same weights.
"""

import copy
import functools

import pytest
import torch
from deepspeed.pipe import TiedLayerSpec
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from launching import CHECK_SCRIPT, REPO, run_pipeline_checks, stage_results  # noqa: F401 (test_lora reads them here)
from rlft.pipeline import (pipeline_batch_iter, policy_layer_specs, position_ids_from_mask, stage_layer_range,
                           valid_stage_counts)

NUM_LAYERS = 5  # 2 stages: 3+2 layers; 3 stages: 2+2+1
TOL = 1e-5


# --------------------------------------------------------------------------------------------
# Stage split
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers,num_stages,expected", [
    (5, 2, [(0, 3), (3, 5)]),
    (7, 3, [(0, 3), (3, 6), (6, 7)]),
    (24, 4, [(0, 6), (6, 12), (12, 18), (18, 24)]),
    (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    (3, 1, [(0, 3)]),
])
def test_stage_layer_range_ceil_split(num_layers, num_stages, expected):
    assert [stage_layer_range(num_layers, num_stages, s) for s in range(num_stages)] == expected


def test_stage_split_refuses_an_empty_stage_and_names_valid_counts():
    # ceil(4/3) = 2 -> 2, 2, 0
    with pytest.raises(ValueError, match=r"4 decoder layers into 3 .*\[2, 2, 0\].*\[1, 2, 4\]"):
        stage_layer_range(4, 3, 0)
    with pytest.raises(ValueError, match="3 decoder layers into 5"):
        stage_layer_range(3, 5, 0)
    with pytest.raises(ValueError, match="out of range"):
        stage_layer_range(5, 2, 2)
    assert valid_stage_counts(7) == [1, 2, 3, 4, 7]  # 5 and 6 stages: ceil gives 2 -> a 0 stage


# --------------------------------------------------------------------------------------------
# Layer maths, in-process
# --------------------------------------------------------------------------------------------

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.1, pad_token_id=0)


def tiny_llama(**kw):  # SmolLM2-like: Llama with tied embeddings
    return LlamaConfig(**{**TINY, "num_hidden_layers": NUM_LAYERS, "head_dim": 16, "tie_word_embeddings": True,
                          **kw})


def tiny_qwen2(**kw):  # attention biases, untied head
    return Qwen2Config(**{**TINY, "num_hidden_layers": NUM_LAYERS, "tie_word_embeddings": False, **kw})


def random_hf_model(config, seed):
    """An HF model whose weights (norm scales and biases too) are all random, so that a wrong
    position, mask or name mapping shows up far above the 1e-5 tolerance."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model.eval()


def padded_batch(seed, rows, T, left=(), right=(), vocab=128):
    """``input_ids``/``attention_mask`` ``[rows,T]``; ``left[i]``/``right[i]`` pads of row i (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, T), generator=g)
    mask = torch.ones(rows, T, dtype=torch.long)
    for i, n in enumerate(left):
        mask[i, :n] = 0
    for i, n in enumerate(right):
        if n:
            mask[i, T - n:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def hf_logprobs(model, batch, attention_mask=True):
    """HF reference: ``(logp, entropy)`` ``[B,T-1]`` with positions counted over real tokens."""
    mask = batch["attention_mask"] if attention_mask else None
    logits = model(input_ids=batch["input_ids"], attention_mask=mask,
                   position_ids=position_ids_from_mask(batch["attention_mask"])).logits
    logp_all = logits[:, :-1].float().log_softmax(-1)
    logp = logp_all.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1).detach()


def scored(batch):
    """``[B,T-1]`` bool: positions whose context token and target token are both real."""
    mask = batch["attention_mask"].bool()
    return mask[:, 1:] & mask[:, :-1]


def chained_layers(config, state_dict):
    """The pipeline's layers in one process (weights copied by HF name) as one function, and the
    HF name of every parameter it trains."""
    built, funcs = {}, []
    for spec in policy_layer_specs(config):
        if isinstance(spec, TiedLayerSpec):
            layer = built.setdefault(spec.key, spec.build())
            funcs.append(functools.partial(spec.forward_fn, layer) if spec.forward_fn else layer)
        else:
            layer = built[len(built)] = spec.build()
            funcs.append(layer)
    params = {}
    with torch.no_grad():
        for layer in built.values():
            for name, p in layer.named_parameters():
                p.copy_(state_dict[layer.hf_name(name)])
                params[layer.hf_name(name)] = p

    def run(inputs):
        for f in funcs:
            inputs = f(inputs)
        return inputs
    run.modules = [m for layer in built.values() for m in layer.modules()]
    return run, params


def run_layers_in_order(config, state_dict, inputs):
    """All of the pipeline's layers in one process, weights copied in by their HF names."""
    run, _ = chained_layers(config, state_dict)
    return run(inputs)


@pytest.mark.parametrize("family,config", [
    ("llama", tiny_llama(num_hidden_layers=2)),
    ("qwen2", tiny_qwen2(num_hidden_layers=2)),
    ("qwen3", Qwen3Config(**TINY, num_hidden_layers=2, head_dim=16, tie_word_embeddings=True)),
    # sliding windows of 3 tokens over 9: the mask must apply them as HF does, per layer type
    ("mistral-sliding", MistralConfig(**TINY, num_hidden_layers=2, head_dim=16, sliding_window=3)),
    ("qwen2-sliding", tiny_qwen2(num_hidden_layers=2, use_sliding_window=True, sliding_window=3,
                                 max_window_layers=1)),
])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_layers_chained_match_hf(family, config, attn):
    config._attn_implementation = attn
    model = random_hf_model(config, seed=1)
    batch = padded_batch(2, rows=4, T=9, left=(3, 0, 1, 0), right=(0, 2, 0, 0))
    logp, entropy = run_layers_in_order(config, model.state_dict(), (batch["input_ids"], batch["attention_mask"]))
    with torch.no_grad():
        ref_logp, ref_entropy = hf_logprobs(model, batch)
        unmasked_logp, _ = hf_logprobs(model, batch, attention_mask=False)  # attends to the pads
    valid = scored(batch)
    assert logp.dtype == torch.float32 and logp.shape == (4, 8) and entropy.shape == (4, 8)
    assert (logp - ref_logp)[valid].abs().max() <= TOL
    assert (entropy - ref_entropy)[valid].abs().max() <= TOL
    # The comparison is sensitive: letting the left-padded row see its pads moves it far off.
    assert (logp - unmasked_logp)[0][valid[0]].abs().max() > 1e-2
    if family.endswith("sliding"):  # ... and so does attending beyond the window
        full = copy.deepcopy(config)
        full.sliding_window, full.layer_types = None, ["full_attention"] * full.num_hidden_layers
        full_model = AutoModelForCausalLM.from_config(full).eval()
        full_model.load_state_dict(model.state_dict())
        with torch.no_grad():
            full_logp, _ = hf_logprobs(full_model, batch)
        assert (logp - full_logp)[valid].abs().max() > 1e-2


@pytest.mark.parametrize("family,config", [("llama", tiny_llama(num_hidden_layers=2)),
                                           ("qwen2", tiny_qwen2(num_hidden_layers=2))])
def test_rows_flushed_left_run_unmasked_and_match_hf_on_the_padded_rows(family, config):
    """The policy trains on rows moved to start at column 0 (`RolloutBatch.flush_left`), where SDPA
    runs causal with no mask at all.  Log-probs, and gradients of their sum over the scored
    positions, equal HF's on the original left- and right-padded rows, position by position."""
    from rlft.batching.batch import RolloutBatch
    from rlft.pipeline.stages import StageContext

    config._attn_implementation = "sdpa"
    model = random_hf_model(config, seed=4)
    batch = padded_batch(5, rows=4, T=9, left=(3, 0, 1, 2), right=(0, 2, 0, 1))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    rows = RolloutBatch(input_ids=ids, attention_mask=mask, response_mask=scored(batch).float(),
                        prompt_lengths=torch.ones(4, dtype=torch.long), response_lengths=torch.ones(4, dtype=torch.long))
    flushed = rows.flush_left()
    lead = torch.tensor([3, 0, 1, 2])
    for r in range(4):  # each row moved by its leading pads, its labels with it
        assert torch.equal(flushed.input_ids[r], ids[r].roll(-int(lead[r])))
        assert torch.equal(flushed.response_mask[r], rows.response_mask[r].roll(-int(lead[r])))
    context = StageContext(config)
    assert context.mask(flushed.attention_mask, "sdpa", torch.float32, None) is None
    assert context.mask(mask, "sdpa", torch.float32, None) is not None
    assert context.mask(flushed.attention_mask, "eager", torch.float32, None) is not None

    run, params = chained_layers(config, model.state_dict())
    # The layers' attention may use flash, memory-efficient or math kernels, never cuDNN's (its host
    # time per call held the GPU idle); the global setting is back as it was afterwards.
    seen = []
    for module in run.modules:
        if module.__class__.__name__.endswith("Attention"):
            module.register_forward_pre_hook(lambda *_: seen.append(
                (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled())))
    logp, _ = run((flushed.input_ids, flushed.attention_mask))
    assert seen == [(False, True)] * config.num_hidden_layers
    assert torch.backends.cuda.cudnn_sdp_enabled()
    (logp * flushed.response_mask).sum().backward()
    ref_logp, _ = hf_logprobs(model, batch)
    (ref_logp * rows.response_mask).sum().backward()
    for r in range(4):
        n = int(rows.response_mask[r].sum())
        got = logp[r][flushed.response_mask[r].bool()]
        want = ref_logp[r][rows.response_mask[r].bool()]
        assert got.shape == (n,) and (got - want).abs().max() <= TOL, (family, r)
    hf_params = dict(model.named_parameters())
    for name, p in params.items():
        want = hf_params[name].grad
        assert (p.grad - want).abs().max() <= TOL * max(1.0, float(want.abs().max())), name
    assert any(float(p.grad.abs().max()) > 1e-3 for p in params.values())


def test_compiled_layers_share_one_graph_and_match_hf():
    """`model.compile_layers`: each decoder layer runs through torch.compile, the layers share their
    compiled code (one graph per kind of batch, not one per layer), and log-probs and gradients stay
    HF's, on padded rows (with a mask) and on rows flushed left (none)."""
    from torch._dynamo.utils import counters

    from rlft.batching.batch import RolloutBatch
    from rlft.pipeline import compile_decoder_layers
    from rlft.pipeline.stages import DecoderLayerPipe

    config = tiny_qwen2(num_hidden_layers=3)
    config._attn_implementation = "sdpa"
    model = random_hf_model(config, seed=6)
    batch = padded_batch(7, rows=3, T=8, left=(2, 0, 1), right=(0, 3, 0))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    run, params = chained_layers(config, model.state_dict())
    torch._dynamo.reset()
    counters.clear()
    assert compile_decoder_layers(torch.nn.ModuleList(m for m in run.modules if isinstance(m, DecoderLayerPipe))) == 3
    ref_logp, _ = hf_logprobs(model, batch)
    (ref_logp * scored(batch)).sum().backward()
    hf_grads = {name: p.grad for name, p in model.named_parameters()}
    logp, _ = run((ids, mask))
    assert (logp - ref_logp.detach())[scored(batch)].abs().max() <= TOL
    (logp * scored(batch)).sum().backward()
    for name, p in params.items():
        want = hf_grads[name]
        assert (p.grad - want).abs().max() <= TOL * max(1.0, float(want.abs().max())), name
    masked_graphs = counters["stats"]["unique_graphs"]
    assert masked_graphs == 1, dict(counters["stats"])  # shared by the three layers
    rows = RolloutBatch(input_ids=ids, attention_mask=mask, response_mask=scored(batch).float(),
                        prompt_lengths=torch.ones(3, dtype=torch.long), response_lengths=torch.ones(3, dtype=torch.long))
    flushed = rows.flush_left()
    flushed_logp, _ = run((flushed.input_ids, flushed.attention_mask))
    for r in range(3):
        got = flushed_logp[r][flushed.response_mask[r].bool()]
        want = ref_logp[r][rows.response_mask[r].bool()].detach()
        assert (got - want).abs().max() <= TOL, r
    assert counters["stats"]["unique_graphs"] - masked_graphs <= 1  # the unmasked kind: once more, not per layer
    torch._dynamo.reset()


@pytest.mark.parametrize("family,config", [("llama-tied", tiny_llama(num_hidden_layers=1)),
                                           ("qwen2-untied", tiny_qwen2(num_hidden_layers=1))])
def test_compiling_fuses_the_output_layer_and_it_matches_hf(family, config, monkeypatch):
    """`compile_decoder_layers` also sets the output layer (an untied head, or the tied embedding)
    to fused chunks; with chunks forced (no plain way), log-probs and every gradient, the tied
    embedding's from both of its uses included, equal HF's."""
    import rlft.pipeline.token_logprobs as tl
    from rlft.pipeline import compile_decoder_layers
    from rlft.pipeline.stages import EmbeddingPipe, LMHeadPipe

    monkeypatch.setattr(tl, "PLAIN_MAX_ELEMENTS", 0)
    monkeypatch.setattr(tl, "FUSED_CHUNK_BYTES", 5 * 4 * config.vocab_size)  # chunks of 5 fp32 tokens
    config._attn_implementation = "sdpa"
    model = random_hf_model(config, seed=8)
    batch = padded_batch(9, rows=3, T=8, left=(2, 0, 1), right=(0, 3, 0))
    run, params = chained_layers(config, model.state_dict())
    heads = [m for m in run.modules if isinstance(m, (LMHeadPipe, EmbeddingPipe))]
    assert compile_decoder_layers(torch.nn.ModuleList(heads)) == 0
    assert all(m.fused_logprobs for m in heads)
    used = []
    real = tl._compiled
    monkeypatch.setattr(tl, "_compiled", lambda fn: used.append(fn.__name__) or real(fn))
    logp, _ = run((batch["input_ids"], batch["attention_mask"]))
    (logp * scored(batch)).sum().backward()
    assert used == ["_chunk_stats", "_chunk_grad_logits"]
    ref_logp, _ = hf_logprobs(model, batch)
    (ref_logp * scored(batch)).sum().backward()
    assert (logp - ref_logp.detach())[scored(batch)].abs().max() <= TOL, family
    hf_params = dict(model.named_parameters())
    for name, p in params.items():
        want = hf_params[name].grad
        assert (p.grad - want).abs().max() <= TOL * max(1.0, float(want.abs().max())), name


def test_refuses_unsupported_families_and_attention():
    with pytest.raises(ValueError, match="'gpt2' cannot be split by the policy pipeline: no model family record"):
        policy_layer_specs(GPT2Config())
    config = tiny_llama()
    config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="flash_attention_2"):
        policy_layer_specs(config)


def test_pipeline_batch_iter_cuts_rows_and_orders_labels():
    batch = padded_batch(0, rows=4, T=5, left=(1, 0, 0, 2))
    batch["attention_mask"] = batch["attention_mask"].bool()
    batch["adv"] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    batch["response_mask"] = torch.arange(16.0).reshape(4, 4)
    micro = list(pipeline_batch_iter(batch, 2, label_keys=("response_mask", "adv")))
    assert len(micro) == 2
    (ids, mask), (resp, adv) = micro[1]
    assert torch.equal(ids, batch["input_ids"][2:]) and mask.dtype == torch.long
    assert torch.equal(mask, batch["attention_mask"][2:].long())
    assert torch.equal(resp, batch["response_mask"][2:]) and torch.equal(adv, torch.tensor([3.0, 4.0]))
    with pytest.raises(ValueError, match="micro_batch_size 3 must divide the batch size 4"):
        next(pipeline_batch_iter(batch, 3))
    with pytest.raises(KeyError, match="old_logp"):
        next(pipeline_batch_iter(batch, 2, label_keys=("old_logp",)))


# --------------------------------------------------------------------------------------------
# The pipeline under the deepspeed launcher
# --------------------------------------------------------------------------------------------

MICRO_BATCH, GAS = 2, 2
CASES = {  # name -> (config factory, attention, activation checkpoint interval, weights given as, compiled layers)
    "llama_tied_sdpa": (tiny_llama, "sdpa", 0, "dir", False),
    "qwen2_untied_eager": (tiny_qwen2, "eager", 0, "state_dict", False),
    "llama_tied_eager_ckpt": (tiny_llama, "eager", 1, "sharded_dir", False),
    "qwen2_untied_sdpa_ckpt_compiled": (tiny_qwen2, "sdpa", 1, "dir", True),  # model.compile_layers
}
LAUNCHES = {2: ["llama_tied_sdpa", "qwen2_untied_eager", "llama_tied_eager_ckpt", "qwen2_untied_sdpa_ckpt_compiled"],
            3: ["llama_tied_sdpa", "qwen2_untied_eager"]}


def train_batch():
    """4 rows, T=8: left-padded prompts, right-padded responses; response_mask marks targets."""
    #          (left pad, prompt, response, right pad)
    layout = [(2, 3, 3, 0), (0, 3, 4, 1), (1, 4, 2, 1), (0, 2, 6, 0)]
    batch = padded_batch(3, rows=4, T=8, left=[r[0] for r in layout], right=[r[3] for r in layout])
    response = torch.zeros(4, 8)
    for i, (left, prompt, resp, _) in enumerate(layout):
        response[i, left + prompt:left + prompt + resp] = 1.0
    batch["response_mask"] = response[:, 1:]  # target t+1 is a response token
    return batch


BATCHES = {
    "eval_before": padded_batch(4, rows=5, T=9, left=(3, 0, 1, 0, 4)),  # 5 rows: last micro-batch padded
    "train": train_batch(),
    "eval_after": padded_batch(5, rows=4, T=7, right=(0, 2, 0, 3)),  # new length after training
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (saved model dir, the HF model in eval mode)."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for seed, (name, (factory, attn, _, load_from, _)) in enumerate(CASES.items()):
        config = factory()
        config._attn_implementation = attn
        model = random_hf_model(config, seed=10 + seed)
        # sharded: several .safetensors files and an index, which load_hf_weights follows
        model.save_pretrained(root / name, max_shard_size="200KB" if load_from == "sharded_dir" else "1GB")
        out[name] = (root / name, model)
    return out


@pytest.fixture(scope="module")
def launches(models, tmp_path_factory):
    """num_stages -> out dir of one ``deepspeed --num_gpus num_stages`` run over its cases."""
    def case(name):
        return {"name": name, "model_dir": str(models[name][0]),
                "load_from": "state_dict" if CASES[name][3] == "state_dict" else "dir",
                "attn_implementation": CASES[name][1], "micro_batch_size": MICRO_BATCH,
                "gradient_accumulation_steps": GAS, "activation_checkpoint_interval": CASES[name][2],
                "compile_layers": CASES[name][4]}
    return run_pipeline_checks(tmp_path_factory.mktemp("launch"), BATCHES,
                               {num_stages: [case(name) for name in names] for num_stages, names in LAUNCHES.items()})


LAUNCHED = [(n, name) for n, names in LAUNCHES.items() for name in names]


@pytest.mark.parametrize("num_stages,name", LAUNCHED)
def test_stages_hold_the_ceil_split(launches, num_stages, name):
    for s, res in enumerate(stage_results(launches, num_stages, name)):
        start, end = stage_layer_range(NUM_LAYERS, num_stages, s)
        assert res["layer_range"] == (start, end)
        held = {int(k.split(".")[2]) for k in res["grads"] if k.startswith("model.layers.")}
        assert held == set(range(start, end))
        assert ("model.embed_tokens.weight" in res["grads"]) == (s == 0)
        assert ("model.norm.weight" in res["grads"]) == (s == num_stages - 1)
        # load_hf_weights is strict: an empty source names each of the stage's parameters
        names = set(res["grads"]) | set(res["replica_grads"])
        assert f"stage {s}: {len(names)} parameter(s) not found" in res["missing_error"]
        assert all(name in res["missing_error"] for name in names)


@pytest.mark.parametrize("num_stages,name", LAUNCHED)
def test_compiled_cases_run_their_layers_compiled(launches, num_stages, name):
    """The compiled case's layers ran through torch.compile on every stage (the tests below then hold
    it to HF's numbers), in a few graphs shared by the stage's layers; the other cases compiled none."""
    graphs = [res["compiled_graphs"] for res in stage_results(launches, num_stages, name)]
    if CASES[name][4]:
        assert all(1 <= g <= 6 for g in graphs), graphs
    else:
        assert graphs == [0] * num_stages


@pytest.mark.parametrize("num_stages,name", LAUNCHED)
def test_eval_logprobs_match_hf(launches, models, num_stages, name):
    model = models[name][1]
    results = stage_results(launches, num_stages, name)
    for res in results[:-1]:
        assert res["eval_before"] is None and res["eval_after"] is None
    for key in ("eval_before", "eval_after"):  # left padding T=9, then right padding T=7
        logp, entropy = results[-1][key]
        with torch.no_grad():
            ref_logp, ref_entropy = hf_logprobs(model, BATCHES[key])
        assert logp.shape == ref_logp.shape
        valid = scored(BATCHES[key])
        assert (logp - ref_logp)[valid].abs().max() <= TOL
        assert (entropy - ref_entropy)[valid].abs().max() <= TOL


def hf_reference_step(model):
    """Loss, metrics and gradients of the HF model for the check script's loss over GAS micro-batches."""
    model.zero_grad()
    batch, losses, entropies, tokens = BATCHES["train"], [], [], []
    for lo in range(0, MICRO_BATCH * GAS, MICRO_BATCH):
        mb = {k: v[lo:lo + MICRO_BATCH] for k, v in batch.items()}
        logp, entropy = hf_logprobs(model, mb)
        n = mb["response_mask"].sum()
        loss = -(logp * mb["response_mask"]).sum() / n
        (loss / GAS).backward()  # DeepSpeed scales each micro-batch loss by 1/GAS
        losses.append(loss.item())
        entropies.append(((entropy * mb["response_mask"]).sum() / n).item())
        tokens.append(n.item())
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return mean(losses), {"entropy": mean(entropies), "tokens": mean(tokens)}, grads


@pytest.mark.parametrize("num_stages,name", LAUNCHED)
def test_train_batch_gradients_match_hf(launches, models, num_stages, name):
    model = models[name][1]
    ref_loss, ref_metrics, ref_grads = hf_reference_step(model)
    results = stage_results(launches, num_stages, name)
    merged = {}
    for res in results:
        assert not merged.keys() & res["grads"].keys()
        merged.update(res["grads"])
        assert res["loss"].item() == pytest.approx(ref_loss, abs=TOL)  # broadcast to every stage
        assert res["metrics"]["entropy"].item() == pytest.approx(ref_metrics["entropy"], abs=TOL)
        assert res["metrics"]["tokens"].item() == pytest.approx(ref_metrics["tokens"], abs=TOL)
    assert merged.keys() == ref_grads.keys()
    for hf_name, grad in ref_grads.items():
        assert (merged[hf_name] - grad).abs().max() <= TOL, hf_name
    tied = model.config.tie_word_embeddings
    assert ("lm_head.weight" in merged) == (not tied)
    if tied:
        # Both ends hold the full tied gradient (lookup + output projection, all-reduced); a stage
        # with only its own part would be off by far more than the tolerance.
        full = ref_grads["model.embed_tokens.weight"]
        replica = results[-1]["replica_grads"]["model.embed_tokens.weight"]
        assert (replica - full).abs().max() <= TOL
        lookup_only = embedding_lookup_grad(model)
        assert (full - lookup_only).abs().max() > 1e-3
        assert lookup_only.abs().max() > 1e-3


def embedding_lookup_grad(model):
    """Gradient of the reference loss reaching a tied matrix through the embedding lookup only."""
    model.zero_grad()
    batch = BATCHES["train"]
    for lo in range(0, MICRO_BATCH * GAS, MICRO_BATCH):
        mb = {k: v[lo:lo + MICRO_BATCH] for k, v in batch.items()}
        hidden = model.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                             position_ids=position_ids_from_mask(mb["attention_mask"])).last_hidden_state
        logits = torch.nn.functional.linear(hidden[:, :-1], model.lm_head.weight.detach())
        logp = logits.float().log_softmax(-1).gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)
        loss = -(logp * mb["response_mask"]).sum() / mb["response_mask"].sum()
        (loss / GAS).backward()
    grad = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()
    return grad


@pytest.mark.parametrize("num_stages,name", LAUNCHED)
def test_export_merges_into_the_hf_state_dict(launches, models, num_stages, name, tmp_path):
    model_dir, model = models[name]
    merged = {}
    for res in stage_results(launches, num_stages, name):
        assert not merged.keys() & res["export"].keys()
        merged.update(res["export"])
    expected = {k: v for k, v in model.state_dict().items()
                if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    assert merged.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(merged[key], value), key  # lr 0: the step left the loaded weights alone
    save_file(merged, str(tmp_path / "model.safetensors"))
    model.config.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=CASES[name][1]).eval()
    batch = BATCHES["eval_after"]
    with torch.no_grad():
        assert torch.equal(reloaded(**batch).logits, model(**batch).logits)
