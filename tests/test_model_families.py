"""Every decoder family the policy pipeline splits (rlft/models/families.py), against the plain HF model.

In-process, each family's pipeline layers chained give HF's log-probs and gradients (fp32, <= 1e-5),
and dropping the record's feature (the embedding scale, the logit cap or scaling) moves them far off,
so the equality tests what the record says.  Under the real ``deepspeed`` launcher (CPU, gloo;
tests/pipeline_check.py), one launch with 1 stage and one with 2 run every family: log-probs, the
training step's gradients, and the export, which ``from_pretrained`` loads with HF's logits; LoRA cases
(fused projections, soft-capped logits, experts beside the adapted attention) equal the peft model.
Refusals: families that cannot be split, attention soft-capping under SDPA, and engines that cannot
serve a family, each one line before any rank starts.
"""
import dataclasses
import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3Config, Gemma3TextConfig, GemmaConfig,
                          GraniteConfig, MistralConfig, MixtralConfig, Olmo2Config, Phi3Config, Qwen3Config, Qwen3MoeConfig)

from launching import REPO, run_pipeline_checks, stage_results
from rlft.models import families
from rlft.models.families import UnsupportedFamily, family_of
from test_lora import peft_model_of, peft_reference_step
from rlft.pipeline.stages import position_ids_from_mask
from test_pipeline import (BATCHES, GAS, MICRO_BATCH, TINY, TOL, chained_layers, hf_logprobs, hf_reference_step,
                           padded_batch, random_hf_model, scored)

LAYERS = 3  # 2 stages: 2 + 1 layers
FAMILIES = {  # name -> (config factory, attention)
    "mistral": (lambda: MistralConfig(**TINY, num_hidden_layers=LAYERS, head_dim=16, sliding_window=3), "sdpa"),
    "qwen3": (lambda: Qwen3Config(**TINY, num_hidden_layers=LAYERS, head_dim=16, tie_word_embeddings=True), "sdpa"),
    "gemma": (lambda: GemmaConfig(**TINY, num_hidden_layers=LAYERS, head_dim=16), "sdpa"),
    "gemma2": (lambda: Gemma2Config(**TINY, num_hidden_layers=LAYERS, head_dim=16, sliding_window=3,
                                    final_logit_softcapping=2.0, attn_logit_softcapping=3.0,
                                    query_pre_attn_scalar=20), "eager"),
    "gemma3_text": (lambda: Gemma3TextConfig(**TINY, num_hidden_layers=LAYERS, head_dim=16, sliding_window=3,
                                             final_logit_softcapping=2.5,
                                             layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
                    "sdpa"),
    "granite": (lambda: GraniteConfig(**TINY, num_hidden_layers=LAYERS, embedding_multiplier=3.0, logits_scaling=4.0,
                                      residual_multiplier=0.5, attention_multiplier=0.3), "sdpa"),
    "olmo2": (lambda: Olmo2Config(**TINY, num_hidden_layers=LAYERS), "eager"),
    "phi3": (lambda: Phi3Config(**TINY, num_hidden_layers=LAYERS), "sdpa"),
    "mixtral": (lambda: MixtralConfig(**TINY, num_hidden_layers=LAYERS, head_dim=16, num_local_experts=4,
                                      num_experts_per_tok=2), "sdpa"),
    "qwen3_moe": (lambda: Qwen3MoeConfig(**TINY, num_hidden_layers=LAYERS, head_dim=16, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True), "sdpa"),
}
# What each record says beyond Llama's form, dropped: the pipeline must then differ from HF.
FEATURES = [
    ("gemma", {"embedding_scale": None}),
    ("gemma2", {"logits_softcap": None}),
    ("gemma2", {"embedding_scale": None}),
    ("gemma3_text", {"embedding_scale": None}),
    ("gemma3_text", {"logits_softcap": None}),
    ("granite", {"logits_divisor": None}),
    ("granite", {"embedding_scale": None}),
]
LORA = {  # name -> LoRA settings on the family's own projections
    "phi3": {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]},
    "gemma2": {"rank": 4, "alpha": 8.0, "dropout": 0.0,
               "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
    "qwen3_moe": {"rank": 2, "alpha": 4.0, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "granite": {"rank": 2, "alpha": 4.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]},
}


def family_model(name, seed):
    config = FAMILIES[name][0]()
    config._attn_implementation = FAMILIES[name][1]
    return config, random_hf_model(config, seed)


# --------------------------------------------------------------------------------------------
# In-process: the stage layers chained
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_layers_chained_match_hf_logprobs_and_gradients(name):
    assert family_of(FAMILIES[name][0]()).model_type == name
    config, model = family_model(name, seed=1)
    batch = padded_batch(2, rows=4, T=9, left=(3, 0, 1, 0), right=(0, 2, 0, 0))
    run, params = chained_layers(config, model.state_dict())
    logp, entropy = run((batch["input_ids"], batch["attention_mask"]))[:2]  # experts: the routers' loss last
    ref_logp, ref_entropy = hf_logprobs(model, batch)
    valid = scored(batch)
    assert (logp - ref_logp.detach())[valid].abs().max() <= TOL
    assert (entropy - ref_entropy)[valid].abs().max() <= TOL
    (logp * valid).sum().backward()
    (ref_logp * valid).sum().backward()
    hf_params = dict(model.named_parameters())
    assert params.keys() == {k for k in hf_params if not (k == "lm_head.weight" and "lm_head.weight" not in params)}
    for key, p in params.items():
        want = hf_params[key].grad
        assert (p.grad - want).abs().max() <= TOL * max(1.0, float(want.abs().max())), key
    assert max(float(p.grad.abs().max()) for p in params.values()) > 1e-3


@pytest.mark.parametrize("name,dense", [("qwen3_moe", []), ("qwen3_moe", [1]), ("mixtral", [])])
def test_the_routers_load_balancing_loss_is_hfs_aux_loss(name, dense):
    """The stages' sums of every router layer (rlft/pipeline/router.py) give HF's ``aux_loss`` on a padded
    batch, and its gradient on every router; a dense layer among them (``mlp_only_layers``) has none."""
    config = FAMILIES[name][0]()
    config._attn_implementation = FAMILIES[name][1]
    if dense:
        config.mlp_only_layers = dense
    model = random_hf_model(config, seed=8)
    batch = padded_batch(6, rows=3, T=8, left=(3, 0, 1), right=(0, 2, 0))
    run, params = chained_layers(config, model.state_dict())
    *_, aux = run((batch["input_ids"], batch["attention_mask"]))
    ref = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True,
                position_ids=position_ids_from_mask(batch["attention_mask"])).aux_loss
    assert abs(aux.item() - ref.item()) <= TOL and ref.item() > 1.0  # top_k (2) for evenly loaded experts
    aux.backward()
    ref.backward()
    routers = [key for key in params if key.endswith(".mlp.gate.weight")]
    assert len(routers) == LAYERS - len(dense)
    for key in routers:
        want = dict(model.named_parameters())[key].grad
        assert want.abs().max() > 1e-4 and (params[key].grad - want).abs().max() <= TOL, key
    # The pads are left out: counting them (the same ids, no pads) gives another loss.
    unpadded = padded_batch(6, rows=3, T=8)
    *_, aux_all = run((unpadded["input_ids"], unpadded["attention_mask"]))
    assert abs(aux_all.item() - aux.item()) > 1e-4


@pytest.mark.parametrize("name,dropped", FEATURES)
def test_each_record_feature_matters(name, dropped, monkeypatch):
    config, model = family_model(name, seed=2)
    record = families.MODEL_FAMILIES[name]
    monkeypatch.setitem(families.MODEL_FAMILIES, name, dataclasses.replace(record, **dropped))
    batch = padded_batch(3, rows=2, T=7, left=(2, 0))
    run, _ = chained_layers(config, model.state_dict())
    with torch.no_grad():
        logp, _ = run((batch["input_ids"], batch["attention_mask"]))
        ref_logp, _ = hf_logprobs(model, batch)
    assert (logp - ref_logp)[scored(batch)].abs().max() > 1e-2


def test_gemma3_layers_use_their_own_rotary_tables():
    """Sliding layers rotate with the local base frequency, full ones with the global one: swapping the
    tables moves the log-probs far off."""
    from rlft.pipeline.stages import StageContext

    config, model = family_model("gemma3_text", seed=3)
    batch = padded_batch(4, rows=2, T=8)
    context = StageContext(config)
    hidden = torch.zeros(2, 8, 64)
    local = context.rope(batch["attention_mask"], hidden, "sliding_attention")
    full = context.rope(batch["attention_mask"], hidden, "full_attention")
    assert (local[0] - full[0]).abs().max() > 1e-2
    config.rope_parameters["sliding_attention"]["rope_theta"] = config.rope_parameters["full_attention"]["rope_theta"]
    run, _ = chained_layers(config, model.state_dict())
    with torch.no_grad():
        logp, _ = run((batch["input_ids"], batch["attention_mask"]))
        ref_logp, _ = hf_logprobs(model, batch)
    assert (logp - ref_logp)[scored(batch)].abs().max() > 1e-3


@pytest.mark.parametrize("transform", [(4.0, None), (None, 2.0), (0.5, 3.0)])
def test_chunked_logprobs_apply_the_logit_transform_and_its_gradient(transform):
    """Chunks of 3 tokens equal the whole vocabulary at once with the same (divisor, softcap), values
    and gradients; the transform moves both."""
    from rlft.pipeline.token_logprobs import next_token_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 6, 16, generator=g, requires_grad=True)
    weight = (torch.randn(40, 16, generator=g) * 2).requires_grad_(True)
    ids = torch.randint(0, 40, (2, 6), generator=g)
    out = {}
    for key, kwargs in (("plain", {}), ("chunked", {"chunk_tokens": 3}), ("bare", {})):
        hidden.grad = weight.grad = None
        logp, entropy = next_token_logprobs(hidden, weight, ids, True, logit_transform=None if key == "bare" else transform,
                                            **kwargs)
        logp.sum().backward()
        out[key] = (logp.detach(), entropy, hidden.grad.clone(), weight.grad.clone())
    for a, b in zip(out["plain"], out["chunked"]):
        assert (a - b).abs().max() <= TOL
    assert (out["plain"][0] - out["bare"][0]).abs().max() > 1e-2
    assert (out["plain"][3] - out["bare"][3]).abs().max() > 1e-2


# --------------------------------------------------------------------------------------------
# Under the deepspeed launcher: 1 and 2 stages, every family in each launch
# --------------------------------------------------------------------------------------------

CHECKPOINTED = ("gemma3_text", "qwen3_moe")  # activation checkpointing: layers recomputed in backward
AUX_COEF = 0.5  # qwen3_moe_aux: the routers' load-balancing loss on (HF's switch), weighed heavily
CASES = {**{name: (name, 0) for name in FAMILIES}, **{f"{name}_ckpt": (name, 1) for name in CHECKPOINTED},
         "qwen3_moe_aux": ("qwen3_moe_aux", 0)}
LAUNCHED = [(n, case) for n in (1, 2) for case in CASES]
LORA_LAUNCHED = [(n, name) for n in (1, 2) for name in LORA]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (saved dir, HF model); ``<name>_lora`` -> (base dir, base model, peft model, adapter dir)."""
    root = tmp_path_factory.mktemp("family_models")
    out = {}
    for seed, name in enumerate(FAMILIES):
        _, model = family_model(name, seed=40 + seed)
        model.save_pretrained(root / name)
        out[name] = (root / name, model)
        if name == "qwen3_moe":  # the same weights, the aux loss switched on in its config
            model.config.output_router_logits, model.config.router_aux_loss_coef = True, AUX_COEF
            model.save_pretrained(root / "qwen3_moe_aux")
            out["qwen3_moe_aux"] = (root / "qwen3_moe_aux", model)
            model.config.output_router_logits = False
        if name in LORA:
            peft_model = peft_model_of(model, LORA[name], seed=60 + seed)
            peft_model.save_pretrained(root / f"{name}_adapter")
            out[f"{name}_lora"] = (root / name, model, peft_model, root / f"{name}_adapter")
    return out


@pytest.fixture(scope="module")
def launches(models, tmp_path_factory):
    def case(case_name, name, checkpointed=0, lora=False):
        c = {"name": case_name, "model_dir": str(models[name][0]), "load_from": "dir",
             "attn_implementation": FAMILIES[name.removesuffix("_aux")][1], "micro_batch_size": MICRO_BATCH,
             "gradient_accumulation_steps": GAS, "activation_checkpoint_interval": checkpointed}
        if lora:
            c["lora"] = {"settings": LORA[name], "seed": 5, "adapter_dir": str(models[f"{name}_lora"][3])}
        return c
    cases = [case(case_name, *CASES[case_name]) for case_name in CASES]
    cases += [case(f"{name}_lora", name, lora=True) for name in LORA]
    return run_pipeline_checks(tmp_path_factory.mktemp("family_launch"), BATCHES, {1: cases, 2: cases})


def merged(results, key):
    out = {}
    for res in results:
        assert not out.keys() & res[key].keys()
        out.update(res[key])
    return out


@pytest.mark.parametrize("num_stages,case", [(n, case) for n, case in LAUNCHED if case != "qwen3_moe_aux"])
def test_pipeline_logprobs_and_gradients_match_hf(launches, models, num_stages, case):
    model = models[CASES[case][0]][1]
    results = stage_results(launches, num_stages, case)
    for key in ("eval_before", "eval_after"):
        logp, entropy = results[-1][key]
        with torch.no_grad():
            ref_logp, ref_entropy = hf_logprobs(model, BATCHES[key])
        valid = scored(BATCHES[key])
        assert (logp - ref_logp)[valid].abs().max() <= TOL
        assert (entropy - ref_entropy)[valid].abs().max() <= TOL
    ref_loss, _, ref_grads = hf_reference_step(model)
    grads = merged(results, "grads")
    assert grads.keys() == ref_grads.keys()
    for key, grad in ref_grads.items():
        assert (grads[key] - grad).abs().max() <= TOL * max(1.0, float(grad.abs().max())), key
    assert all(res["loss"].item() == pytest.approx(ref_loss, abs=TOL) for res in results)


@pytest.mark.parametrize("num_stages", [1, 2])
def test_the_routers_aux_loss_is_reported_and_trained_as_hf_adds_it(launches, models, num_stages):
    """qwen3_moe with ``output_router_logits`` on: every stage reports HF's ``aux_loss`` of the
    micro-batches, the loss is the NLL plus ``router_aux_loss_coef`` times it, and the gradients are HF's
    of that sum; with the switch off the same model reports the same aux loss and trains on the NLL alone
    (its routers' gradients differ)."""
    model = models["qwen3_moe_aux"][1]
    batch, auxes, losses = BATCHES["train"], [], []
    model.zero_grad()
    for lo in range(0, MICRO_BATCH * GAS, MICRO_BATCH):
        mb = {k: v[lo:lo + MICRO_BATCH] for k, v in batch.items()}
        out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], output_router_logits=True,
                    position_ids=position_ids_from_mask(mb["attention_mask"]))
        logp = out.logits[:, :-1].float().log_softmax(-1).gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)
        loss = -(logp * mb["response_mask"]).sum() / mb["response_mask"].sum() + AUX_COEF * out.aux_loss
        (loss / GAS).backward()
        auxes.append(out.aux_loss.item())
        losses.append(loss.item())
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    results = stage_results(launches, num_stages, "qwen3_moe_aux")
    off = stage_results(launches, num_stages, "qwen3_moe")
    for res in results + off:
        assert res["metrics"]["aux_loss"].item() == pytest.approx(sum(auxes) / GAS, abs=TOL)
    assert all(res["loss"].item() == pytest.approx(sum(losses) / GAS, abs=TOL) for res in results)
    grads, grads_off = merged(results, "grads"), merged(off, "grads")
    assert grads.keys() == ref_grads.keys()
    for key, grad in ref_grads.items():
        assert (grads[key] - grad).abs().max() <= TOL * max(1.0, float(grad.abs().max())), key
    router = "model.layers.0.mlp.gate.weight"
    assert (grads[router] - grads_off[router]).abs().max() > 1e-3


@pytest.mark.parametrize("num_stages", [1, 2])
def test_mixtral_reports_its_routers_aux_loss(launches, models, num_stages):
    """Mixtral's routers (``num_local_experts``) give HF's ``aux_loss`` too, reported on every stage."""
    model, batch, auxes = models["mixtral"][1], BATCHES["train"], []
    with torch.no_grad():
        for lo in range(0, MICRO_BATCH * GAS, MICRO_BATCH):
            mb = {k: v[lo:lo + MICRO_BATCH] for k, v in batch.items()}
            auxes.append(model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], output_router_logits=True,
                               position_ids=position_ids_from_mask(mb["attention_mask"])).aux_loss.item())
    for res in stage_results(launches, num_stages, "mixtral"):
        assert res["metrics"]["aux_loss"].item() == pytest.approx(sum(auxes) / GAS, abs=TOL)


@pytest.mark.parametrize("num_stages,name", [(n, case) for n, case in LAUNCHED if case in FAMILIES])
def test_export_is_the_checkpoint_and_loads_with_hf_logits(launches, models, num_stages, name, tmp_path):
    """The stages' exports merge into the saved checkpoint's tensors under its names (experts one tensor
    each, as transformers saves them), which from_pretrained loads with the model's logits."""
    model_dir, model = models[name]
    export = merged(stage_results(launches, num_stages, name), "export")
    saved = load_file(str(model_dir / "model.safetensors"))
    if model.config.tie_word_embeddings:
        saved.pop("lm_head.weight", None)
    assert export.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(export[key], value), key
    save_file({k: v.contiguous() for k, v in export.items()}, str(tmp_path / "model.safetensors"))
    model.config.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=FAMILIES[name][1]).eval()
    batch = BATCHES["eval_after"]
    with torch.no_grad():
        assert torch.equal(reloaded(**batch).logits, model(**batch).logits)


@pytest.mark.parametrize("num_stages,name", LORA_LAUNCHED)
def test_lora_on_the_family_projections_matches_peft(launches, models, num_stages, name, tmp_path):
    _, base, peft_model, _ = models[f"{name}_lora"]
    results = stage_results(launches, num_stages, f"{name}_lora")
    logp, _ = results[-1]["eval_after"]
    base_logp, _ = results[-1]["eval_base"]
    with torch.no_grad():
        ref_logp, _ = hf_logprobs(peft_model, BATCHES["eval_after"])
        ref_base, _ = hf_logprobs(base, BATCHES["eval_after"])
    valid = scored(BATCHES["eval_after"])
    assert (logp - ref_logp)[valid].abs().max() <= TOL
    assert (base_logp - ref_base)[valid].abs().max() <= TOL
    assert (logp - ref_base)[valid].abs().max() > 1e-2
    ref_loss, ref_grads, _ = peft_reference_step(peft_model)
    grads = merged(results, "adapter_grads")
    assert grads.keys() == ref_grads.keys() and grads
    for key, grad in ref_grads.items():
        assert (grads[key] - grad).abs().max() <= TOL, key
    assert all(not res["frozen_with_grad"] for res in results)
    assert all(res["loss"].item() == pytest.approx(ref_loss, abs=TOL) for res in results)
    # the merged export, under the checkpoint's names, loads as the peft model
    save_file({k: v.contiguous() for k, v in merged(results, "export").items()}, str(tmp_path / "model.safetensors"))
    base.config.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=FAMILIES[name][1]).eval()
    with torch.no_grad():
        reloaded_logp, _ = hf_logprobs(reloaded, BATCHES["eval_after"])
    assert (reloaded_logp - ref_logp)[valid].abs().max() <= TOL


# --------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config,why", [
    (Gemma3Config(text_config={"num_hidden_layers": 2}), "vision tower"),
    ({"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]}, "hybrid linear-attention"),
    ({"model_type": "t5", "is_encoder_decoder": True}, "encoder-decoder"),
    ({"model_type": "gpt2"}, "no model family record"),
    (Gemma3TextConfig(num_hidden_layers=2, use_bidirectional_attention=True), "bidirectional attention"),
])
def test_unsplittable_families_say_why_and_what_works(config, why):
    with pytest.raises(UnsupportedFamily) as e:
        family_of(config)
    message = str(e.value)
    assert why in message and "\n" not in message
    assert "families it splits: llama, mistral, qwen2, qwen3, olmo2, phi3, granite, gemma" in message


def test_attention_softcapping_needs_eager():
    from rlft.pipeline import policy_layer_specs

    config = FAMILIES["gemma2"][0]()
    config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="attn_logit_softcapping=3.0.*model.attn_implementation=eager"):
        policy_layer_specs(config)


NO_VLLM_PLUGIN = """
from rlft.models.families import ModelFamily, register_model_family
register_model_family(ModelFamily("llama_novllm", modeling="transformers.models.llama.modeling_llama",
                                  class_prefix="Llama", vllm=False))
"""


def launch_plan(tmp_path, config_json, *overrides):
    """``python -m rlft.config.launch_plan`` for GRPO on a model directory holding ``config_json``."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(config_json))
    # A safetensors file holding no tensor (its 8-byte header length, then "{}") and a tokenizer file: the
    # launch's checks of the model's files pass, and the family is what is refused.
    (model / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    (model / "tokenizer.json").write_text("{}")
    (tmp_path / "novllm.py").write_text(NO_VLLM_PLUGIN)
    cmd = [sys.executable, "-m", "rlft.config.launch_plan", "--config", str(REPO / "launch/configs/grpo_cpu_demo.yaml"),
           "--module", "rlft.train_grpo", f"model.path={model}", "output.init_checkpoint=null", f"output.dir={tmp_path / 'out'}",
           f"plugins=[{tmp_path / 'novllm.py'}]", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": ""})


def test_refusals_come_before_any_rank_starts(tmp_path):
    t5 = launch_plan(tmp_path, {"model_type": "t5", "is_encoder_decoder": True})
    assert t5.returncode == 2 and t5.stdout == ""
    assert t5.stderr.count("\n") == 1 and "model.path:" in t5.stderr and "encoder-decoder" in t5.stderr
    assert "families it splits: llama" in t5.stderr
    gemma2 = launch_plan(tmp_path, {"model_type": "gemma2", "attn_logit_softcapping": 50.0})
    assert gemma2.returncode == 2 and "set model.attn_implementation=eager" in gemma2.stderr
    assert launch_plan(tmp_path, {"model_type": "gemma2", "attn_logit_softcapping": 50.0},
                       "model.attn_implementation=eager").returncode == 0
    phi3 = launch_plan(tmp_path, {"model_type": "phi3"}, "model.lora.enabled=true")
    assert phi3.returncode == 2
    assert "'q_proj', 'k_proj', 'v_proj', 'gate_proj', 'up_proj' names no projection of phi3" in phi3.stderr
    assert "LoRA may adapt qkv_proj, o_proj, gate_up_proj, down_proj" in phi3.stderr
    assert launch_plan(tmp_path, {"model_type": "phi3"}, "model.lora.enabled=true",
                       "model.lora.target_modules=[qkv_proj,gate_up_proj]").returncode == 0
    aux = {"model_type": "qwen3_moe", "output_router_logits": True, "router_aux_loss_coef": 0.01}
    ckpt = launch_plan(tmp_path, aux, "model.activation_checkpointing=true", "sampling.backend=hf")
    assert ckpt.returncode == 2 and ckpt.stderr.count("\n") == 1
    assert "model.activation_checkpointing:" in ckpt.stderr and "output_router_logits: false" in ckpt.stderr
    assert launch_plan(tmp_path, aux, "sampling.backend=hf").returncode == 0


def test_a_family_vllm_cannot_serve_points_to_the_hf_engine(tmp_path):
    vllm = launch_plan(tmp_path, {"model_type": "llama_novllm"}, "sampling.backend=vllm")
    assert vllm.returncode == 2 and vllm.stderr.count("\n") == 1
    assert "sampling.backend: vLLM cannot serve llama_novllm models" in vllm.stderr
    assert vllm.stderr.strip().endswith("set sampling.backend=hf")
    assert launch_plan(tmp_path, {"model_type": "llama_novllm"}, "sampling.backend=auto").returncode == 0
    # ... and auto passes vLLM over at the rank's start, saying why
    from rlft.engines import BACKENDS
    from rlft.models.families import ModelFamily, register_model_family

    register_model_family(ModelFamily("llama_novllm", modeling="transformers.models.llama.modeling_llama",
                                      class_prefix="Llama", vllm=False))
    try:
        usable = [b.usable(str(tmp_path / "model"), "cpu") for b in BACKENDS.values()]
        assert [u for u, _ in usable].count(False) >= 1
        assert any("vLLM cannot serve llama_novllm" in why for _, why in usable)
    finally:
        del families.MODEL_FAMILIES["llama_novllm"]


def test_a_family_registered_after_import_is_accepted_everywhere(tmp_path):
    """The list of families is read at each call, not kept from import: a family a plugin registers
    later is in ``SUPPORTED_MODEL_TYPES``, split by the stages (HF's log-probs), checked at launch, and
    gone again once unregistered."""
    import rlft.pipeline
    from rlft.config import build_config
    from rlft.config.model_family import check_model_family
    from rlft.config.schema import ConfigError
    from rlft.models.families import ModelFamily, register_model_family, supported_model_types
    from transformers import LlamaConfig

    assert "llama_late" not in rlft.pipeline.SUPPORTED_MODEL_TYPES
    config = LlamaConfig(**TINY, num_hidden_layers=2)
    config._attn_implementation = "sdpa"
    model = random_hf_model(config, seed=7)
    config.model_type = "llama_late"  # the same layers under a type no record named at import
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama_late"}))
    with pytest.raises(ConfigError, match="model_type 'llama_late' cannot be split"):
        check_model_family(build_config({}), tmp_path)
    register_model_family(ModelFamily("llama_late", modeling="transformers.models.llama.modeling_llama",
                                      class_prefix="Llama"))
    try:
        assert "llama_late" in rlft.pipeline.SUPPORTED_MODEL_TYPES and "llama_late" in supported_model_types()
        assert family_of({"model_type": "llama_late"}).model_type == "llama_late"
        check_model_family(build_config({}), tmp_path)  # accepted before any rank starts
        with pytest.raises(UnsupportedFamily, match="families it splits: .*, llama_late$"):
            family_of({"model_type": "gpt2"})
        batch = padded_batch(8, rows=2, T=7, left=(2, 0))
        run, _ = chained_layers(config, model.state_dict())
        with torch.no_grad():
            logp, _ = run((batch["input_ids"], batch["attention_mask"]))
            ref_logp, _ = hf_logprobs(model, batch)
        assert (logp - ref_logp)[scored(batch)].abs().max() <= TOL
    finally:
        del families.MODEL_FAMILIES["llama_late"]
    assert "llama_late" not in rlft.pipeline.SUPPORTED_MODEL_TYPES
    with pytest.raises(UnsupportedFamily):
        family_of({"model_type": "llama_late"})


def test_the_hf_engine_takes_experts_under_the_checkpoint_names():
    """The weight sync sends a mixture of experts' weights one tensor per expert (the checkpoint's and
    vLLM's names); the HF engine writes them into its fused parameters."""
    from rlft.engines.hf_engine import HFEngine
    from rlft.models.families import checkpoint_tensors
    from tiny_models import build_tiny_tokenizer

    _, start = family_model("qwen3_moe", seed=5)
    _, synced = family_model("qwen3_moe", seed=6)
    engine = HFEngine(start, dtype="float32", tokenizer=build_tiny_tokenizer())
    sent = {key: t for name, p in synced.named_parameters() for key, t in checkpoint_tensors(synced.config, name, p)}
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in sent and "model.layers.0.mlp.experts.gate_up_proj" not in sent
    engine.update_weights(sent.items())
    for name, p in synced.named_parameters():
        assert torch.equal(dict(engine.model.named_parameters())[name], p), name


def test_vllm_on_cpu_is_refused_for_a_family_whose_sync_it_does_not_apply(tmp_path):
    """qwen3_moe's record says vLLM's CPU build keeps its starting experts after a sync
    (tests/test_model_families_vllm.py): auto passes vLLM over on CPU, and naming it is refused with
    the engine that works; on a GPU the record does not object."""
    from rlft.config import build_config
    from rlft.engines import EngineSettingError
    from rlft.engines.vllm_backend import VLLM, _refused_model

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    assert _refused_model(str(tmp_path), "cuda") is None
    why = _refused_model(str(tmp_path), "cpu")
    assert why.startswith("vLLM's CPU build does not compute qwen3_moe models as HF does") and why.endswith("set sampling.backend=hf")
    if importlib.util.find_spec("vllm") is not None:
        assert VLLM.usable(str(tmp_path), "cpu") == (False, why)
    with pytest.raises(EngineSettingError, match="^sampling.backend: vLLM's CPU build does not compute qwen3_moe"):
        VLLM.check(build_config({}), str(tmp_path), "float32", "cpu")
