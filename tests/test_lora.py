"""LoRA policies (rlft.pipeline.lora): peft's adapters inside the pipeline stages.

The pipeline runs under the real ``deepspeed`` launcher (CPU, gloo; tests/pipeline_check.py) with
1 and 3 stages (all-in-one; first, middle and last); its log-probs, adapter gradients, merged export and base-model (adapters off)
log-probs are compared with the same peft model outside the pipeline (fp32, <= 1e-5).
"""

import copy
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from rlft.config import ConfigError, build_config
from rlft.pipeline.lora import peft_lora_config, save_adapter
from launching import run_pipeline_checks, stage_results
from test_pipeline import BATCHES, GAS, MICRO_BATCH, TOL, hf_logprobs, random_hf_model, scored, tiny_llama, tiny_qwen2

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = {  # name -> (config factory, attention, settings)
    "llama_tied_all": (tiny_llama, "sdpa", {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ALL_TARGETS}),
    "qwen2_untied_qv": (tiny_qwen2, "eager", {"rank": 2, "alpha": 6.0, "dropout": 0.0,
                                             "target_modules": ["q_proj", "v_proj"]}),
}
# activation checkpointing: the frozen embedding's output carries no gradient into the first layer
CASES["llama_tied_all_ckpt"] = CASES["llama_tied_all"]
CHECKPOINTED = {"llama_tied_all_ckpt"}
LAUNCHES = {1: ["llama_tied_all", "qwen2_untied_qv"], 3: ["llama_tied_all", "qwen2_untied_qv", "llama_tied_all_ckpt"]}
LAUNCHED = [(n, name) for n, names in LAUNCHES.items() for name in names]
SEED = 7


def peft_model_of(model, settings, seed):
    """The plain peft model: the base model with LoRA on the same modules, every adapter weight
    random (peft's B starts at 0, which would hide a wrong A, a wrong scale or a missing layer)."""
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(
        r=settings["rank"], lora_alpha=settings["alpha"], lora_dropout=settings["dropout"],
        target_modules=settings["target_modules"], task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return peft_model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (base model dir, base HF model, peft model, its adapter dir)."""
    root = tmp_path_factory.mktemp("lora_models")
    out = {}
    for seed, (name, (factory, attn, settings)) in enumerate(CASES.items()):
        config = factory()
        config._attn_implementation = attn
        model = random_hf_model(config, seed=20 + seed)
        model.save_pretrained(root / name)
        peft_model = peft_model_of(model, settings, seed=30 + seed)
        peft_model.save_pretrained(root / f"{name}_adapter")
        out[name] = (root / name, model, peft_model, root / f"{name}_adapter")
    return out


@pytest.fixture(scope="module")
def launches(models, tmp_path_factory):
    def case(name):
        return {"name": name, "model_dir": str(models[name][0]), "load_from": "dir",
                "attn_implementation": CASES[name][1], "micro_batch_size": MICRO_BATCH,
                "gradient_accumulation_steps": GAS, "activation_checkpoint_interval": int(name in CHECKPOINTED),
                "lora": {"settings": CASES[name][2], "seed": SEED, "adapter_dir": str(models[name][3])}}
    return run_pipeline_checks(tmp_path_factory.mktemp("lora_launch"), BATCHES,
                               {n: [case(x) for x in names] for n, names in LAUNCHES.items()})


def merged(results, key):
    out = {}
    for res in results:
        assert not out.keys() & res[key].keys()
        out.update(res[key])
    return out


@pytest.mark.parametrize("num_stages,name", LAUNCHED)
def test_logprobs_match_the_peft_model(launches, models, num_stages, name):
    _, base, peft_model, _ = models[name]
    last = stage_results(launches, num_stages, name)[-1]
    for key, got in (("eval_before", last["eval_before"]), ("eval_after", last["eval_after"]),
                     ("eval_after", last["eval_again"])):  # adapters back on after the base-model pass
        logp, entropy = got
        with torch.no_grad():
            ref_logp, ref_entropy = hf_logprobs(peft_model, BATCHES[key])
            base_logp, _ = hf_logprobs(base, BATCHES[key])
        valid = scored(BATCHES[key])
        assert (logp - ref_logp)[valid].abs().max() <= TOL
        assert (entropy - ref_entropy)[valid].abs().max() <= TOL
        assert (logp - base_logp)[valid].abs().max() > 1e-2  # the adapters matter at this scale


@pytest.mark.parametrize("num_stages,name", LAUNCHED)
def test_adapters_off_give_the_base_model(launches, models, num_stages, name):
    _, base, _, _ = models[name]
    logp, entropy = stage_results(launches, num_stages, name)[-1]["eval_base"]
    with torch.no_grad():
        ref_logp, ref_entropy = hf_logprobs(base, BATCHES["eval_after"])
    valid = scored(BATCHES["eval_after"])
    assert (logp - ref_logp)[valid].abs().max() <= TOL
    assert (entropy - ref_entropy)[valid].abs().max() <= TOL


def peft_reference_step(peft_model):
    """Loss and adapter gradients (peft's saved names) of the check script's loss over GAS micro-batches."""
    peft_model.zero_grad()
    batch, losses = BATCHES["train"], []
    for lo in range(0, MICRO_BATCH * GAS, MICRO_BATCH):
        mb = {k: v[lo:lo + MICRO_BATCH] for k, v in batch.items()}
        logp, _ = hf_logprobs(peft_model, mb)
        loss = -(logp * mb["response_mask"]).sum() / mb["response_mask"].sum()
        (loss / GAS).backward()
        losses.append(loss.item())
    grads = {name.replace(".default.", "."): p.grad.clone() for name, p in peft_model.named_parameters()
             if p.requires_grad}
    frozen_with_grad = [n for n, p in peft_model.named_parameters() if not p.requires_grad and p.grad is not None]
    peft_model.zero_grad()
    return sum(losses) / len(losses), grads, frozen_with_grad


@pytest.mark.parametrize("num_stages,name", LAUNCHED)
def test_only_adapters_get_gradients_equal_to_peft(launches, models, num_stages, name):
    _, _, peft_model, _ = models[name]
    ref_loss, ref_grads, ref_frozen = peft_reference_step(peft_model)
    assert not ref_frozen
    results = stage_results(launches, num_stages, name)
    grads = merged(results, "adapter_grads")
    assert grads.keys() == ref_grads.keys()
    targets = CASES[name][2]["target_modules"]
    assert len(grads) == 2 * len(targets) * base_layers(models[name][1])
    for key, grad in ref_grads.items():
        assert grad.abs().max() > 1e-4, key  # a real gradient, not an untouched zero
        assert (grads[key] - grad).abs().max() <= TOL, key
    for res in results:
        assert res["loss"].item() == pytest.approx(ref_loss, abs=TOL)
        assert res["frozen_with_grad"] == []  # base weights: no gradient at all
        assert res["grads"] and all(".lora_" in k for k in res["grads"])  # every base parameter frozen


def base_layers(model):
    return model.config.num_hidden_layers


@pytest.mark.parametrize("num_stages,name", LAUNCHED)
def test_export_is_the_merged_model(launches, models, num_stages, name):
    _, base, peft_model, _ = models[name]
    results = stage_results(launches, num_stages, name)
    export = merged(results, "export")
    merged_model = copy.deepcopy(peft_model).merge_and_unload()
    expected = {k: v for k, v in merged_model.state_dict().items()
                if not (base.config.tie_word_embeddings and k == "lm_head.weight")}
    assert export.keys() == expected.keys()
    for key, value in expected.items():
        assert (export[key] - value).abs().max() <= 1e-6, key
    # What the sync sends: the adapted projections and those vLLM fuses with them (q/k/v, gate/up),
    # weights and biases; no norms, no embeddings, no other projection.
    adapted = merged(results, "adapted_export")
    targets = CASES[name][2]["target_modules"]
    fused = {"q_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj")}
    sent = {m for t in targets for group in fused.values() for m in (group if t in group else (t,))}
    assert sorted(adapted) == sorted(k for k in expected if k.split(".")[-2] in sent)
    if name == "qwen2_untied_qv":  # k_proj (not a target) travels with q and v, with the biases
        assert {"model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.bias"} <= adapted.keys()
    for key, value in adapted.items():
        assert torch.equal(value, export[key])
        if key.endswith(".weight") and key.split(".")[-2] in targets:
            assert (value - base.state_dict()[key]).abs().max() > 1e-3  # merged, not the base weight
        else:
            assert torch.equal(value, base.state_dict()[key])


@pytest.mark.parametrize("name", LAUNCHES[1])
def test_initial_adapters_do_not_depend_on_the_stage_split(launches, models, name):
    one = merged(stage_results(launches, 1, name), "initial_adapter")
    three = merged(stage_results(launches, 3, name), "initial_adapter")
    assert one.keys() == three.keys() and one
    for key in one:
        assert torch.equal(one[key], three[key]), key
        if ".lora_B." in key:  # peft's initialisation: B = 0, so training starts at the base model
            assert not one[key].any()
        else:
            assert one[key].abs().max() > 0
    _, base, _, _ = models[name]
    export = merged(stage_results(launches, 3, name), "initial_export")
    for key, value in export.items():
        assert torch.equal(value, base.state_dict()[key]), key


def test_saved_adapter_opens_with_peft(launches, models, tmp_path):
    name = "llama_tied_all"
    base_dir, base, peft_model, _ = models[name]
    results = stage_results(launches, 3, name)
    # the pipeline's adapter names are peft's own
    loaded = {n.replace(".default.", "."): p.detach() for n, p in peft_model.named_parameters() if ".lora_" in n}
    assert merged(results, "initial_adapter").keys() == loaded.keys()
    save_adapter(tmp_path / "adapter", loaded, peft_lora_config(SimpleNamespace(**CASES[name][2])), str(base_dir))
    reopened = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter").eval()
    batch = BATCHES["eval_after"]
    with torch.no_grad():
        a, _ = hf_logprobs(reopened, batch)
        b, _ = hf_logprobs(peft_model, batch)
    assert (a - b)[scored(batch)].abs().max() <= TOL


def test_lora_settings_are_checked():
    cfg = build_config({"model": {"lora": {"enabled": True, "rank": 8}}})
    assert cfg.model.lora.enabled and cfg.model.lora.rank == 8 and "down_proj" in cfg.model.lora.target_modules
    assert not build_config({}).model.lora.enabled  # off by default
    for override, words in (("model.lora.rank=0", "model.lora.rank"), ("model.lora.alpha=0", "model.lora.alpha"),
                            ("model.lora.dropout=1.0", "model.lora.dropout"),
                            ("model.lora.target_modules=[]", "model.lora.target_modules")):
        with pytest.raises(ConfigError, match=words):
            build_config({}, [override])
    # A name that matches nothing was left out without a word: q_proj alone was adapted.
    with pytest.raises(ConfigError) as e:
        build_config({"model": {"lora": {"enabled": True, "target_modules": ["q_proj", "v_prj"]}}})
    assert str(e.value) == ("model.lora.target_modules: 'v_prj' names no linear layer of a decoder layer (the "
                            "families' projections: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, "
                            "qkv_proj, gate_up_proj)")


def test_one_gpu_memory_plan_counts_frozen_base_weights_and_adapters(tmp_path):
    from rlft.runtime.memory_plan import lora_parameters, refuse_if_short, shared_gpu_plan

    # The adapters' size, from the config alone, equals what peft adds to the real model.
    settings = {"rank": 3, "alpha": 6.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    model = random_hf_model(tiny_qwen2(), seed=0)
    model.save_pretrained(tmp_path)
    peft_model = peft_model_of(model, settings, seed=0)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert lora_parameters(str(tmp_path), SimpleNamespace(**settings)) == trainable > 0

    # A 7B policy (bf16) beside an engine taking 0.8 of a 140 GiB GPU: fully trained it cannot fit
    # (20 bytes a parameter); with LoRA the base is 2 bytes a parameter and only 40M adapter
    # parameters carry gradients and Adam's moments.
    gib = 2**30
    cfg = build_config({}, ["sampling.backend=vllm", "sampling.vllm.gpu_memory_utilization=0.8",
                            "model.lora.enabled=true", "optim.divergence_factor=0"])
    full = shared_gpu_plan(cfg, total_bytes=140 * gib, params=7_000_000_000, policy_dtype=torch.bfloat16,
                           reference_here=False)
    with pytest.raises(ConfigError, match="cannot share this GPU"):
        refuse_if_short(full, cfg)
    lora = shared_gpu_plan(cfg, total_bytes=140 * gib, params=7_000_000_000, policy_dtype=torch.bfloat16,
                           reference_here=False, adapter_params=40_000_000)
    assert lora["policy"] == pytest.approx((7e9 * 2 + 40e6 * 20) / gib)
    refuse_if_short(lora, cfg)  # fits
