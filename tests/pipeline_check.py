"""Runs the policy pipeline under the real ``deepspeed`` launcher and dumps what each stage sees.

Launched by tests/test_pipeline.py (tests/launching.py) as
``python -m deepspeed.launcher.launch ... tests/pipeline_check.py --spec spec.json`` (N ranks; CPU, gloo); the
test compares the dumps with the plain HF model. ``spec.json``::

    {"data": "batches.pt", "out": "out_dir",
     "cases": [{"name": ..., "model_dir": ..., "attn_implementation": "eager" | "sdpa",
                "micro_batch_size": 2, "gradient_accumulation_steps": 2,
                "activation_checkpoint_interval": 0, "load_from": "dir" | "state_dict",
                "compile_layers": false  (optional: the decoder layers through torch.compile),
                "lora": {"settings": {rank, alpha, dropout, target_modules}, "seed": 0,
                         "adapter_dir": peft adapter directory}  (optional)}, ...]}

``batches.pt`` holds ``{"eval_before": batch, "train": batch, "eval_after": batch}`` (dicts of
``input_ids``, ``attention_mask``, and for train ``response_mask [B,T-1]``). For each case every
rank writes ``out/<case>/stage<k>.pt`` with the log-probs/entropy of both eval batches (last stage),
the training loss and metrics, the gradients under HF names just before the optimizer step (lr 0),
and the stage's :func:`export_hf_state_dict` after the step. With ``lora`` also the adapters as
initialised and their gradients (peft names), the merged export of the adapted weights only, the
frozen parameters that got a gradient (none expected), and ``eval_after`` again with the adapters
off (``eval_base``) and back on (``eval_again``). ``compiled_graphs``: how many graphs torch.compile
made during the case.
"""

import argparse
import json
import os

import deepspeed
import deepspeed.comm as dist
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from rlft.pipeline import (build_policy_pipeline, compile_decoder_layers, export_hf_state_dict, hf_named_parameters,
                           load_hf_weights, pipeline_batch_iter, pipeline_logprobs)


class MaskedNLL:
    """loss = mean of -logp over the response mask; reports the masked mean entropy and the token
    count of each micro-batch through the module's metrics hook.  A mixture of experts: plus its
    routers' load-balancing loss (``aux_loss``, reported) times the family's weight for the config (the
    config's ``router_aux_loss_coef`` where ``output_router_logits`` is on, else 0), as the policy does."""

    def __init__(self, config, checkpointed):
        from rlft.models.families import family_of

        family = family_of(config)
        self.routed = family.router_shape(config) is not None and not checkpointed  # as the stages carry it
        self.aux_weight = family.aux_loss_weight(config)
        self.metric_names = ("entropy", "tokens", *(("aux_loss",) if self.routed else ()))
        self.module = None

    def __call__(self, outputs, labels):
        logp, entropy = outputs[:2]
        (response_mask,) = labels
        tokens = response_mask.sum()
        metrics = {"entropy": (entropy * response_mask).sum() / tokens, "tokens": tokens}
        loss = -(logp * response_mask).sum() / tokens
        if self.routed:
            metrics["aux_loss"] = outputs[-1]
            loss = loss + self.aux_weight * outputs[-1]
        self.module.set_metrics(metrics)
        return loss


def run_case(case, data, out_dir):
    config = AutoConfig.from_pretrained(case["model_dir"])
    config._attn_implementation = case["attn_implementation"]
    loss_fn = MaskedNLL(config, case["activation_checkpoint_interval"])
    module = build_policy_pipeline(config, num_stages=dist.get_world_size(), loss_fn=loss_fn,
                                   activation_checkpoint_interval=case["activation_checkpoint_interval"],
                                   metric_names=loss_fn.metric_names)
    loss_fn.module = module
    try:  # strict: an empty source must name every parameter of this stage
        load_hf_weights(module, {})
        missing_error = None
    except KeyError as err:
        missing_error = str(err)
    if case["load_from"] == "state_dict":
        load_hf_weights(module, load_file(os.path.join(case["model_dir"], "model.safetensors")))
    else:
        load_hf_weights(module, case["model_dir"])  # lazily, from the directory's safetensors
    lora = case.get("lora")
    if lora is not None:  # peft's adapters on the decoder layers; the test's adapter weights loaded in
        from types import SimpleNamespace

        from rlft.pipeline.lora import adapter_state_dict, add_lora, load_adapter_weights, merged_hf_state_dict

        add_lora(module, SimpleNamespace(**lora["settings"]), seed=lora["seed"])
        initial_adapter = {k: v.clone() for k, v in adapter_state_dict(module).items()}
        initial_export = {k: v.clone() for k, v in merged_hf_state_dict(module).items()}
        load_adapter_weights(module, lora["adapter_dir"])
    if case.get("compile_layers"):
        compile_decoder_layers(module)
    mbs, gas = case["micro_batch_size"], case["gradient_accumulation_steps"]
    ds_config = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": gas,
                 "gradient_clipping": 0.0, "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
    # lr 0 keeps the weights, so the eval after the step must still match the HF model.
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.0)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config)

    grads, replica_grads, adapter_grads, frozen_with_grad = {}, {}, {}, []
    take_step = engine._take_model_step

    def capture_grads_then_step(*args, **kwargs):
        # Runs after the tied-weight and data-parallel gradient all-reduces, before the update.
        own = dict(hf_named_parameters(module))
        for name, p in hf_named_parameters(module, include_tied_replicas=True):
            if p.grad is None and not p.requires_grad:  # frozen under LoRA: the test checks it got none
                continue
            target = grads if own.get(name) is p else replica_grads
            target[name] = p.grad.detach().clone()
        if lora is not None:
            from rlft.pipeline.lora import adapter_named_parameters

            adapter_grads.update((name, p.grad.detach().clone()) for name, p in adapter_named_parameters(module))
            frozen_with_grad.extend(n for n, p in module.named_parameters() if not p.requires_grad and p.grad is not None)
        return take_step(*args, **kwargs)

    engine._take_model_step = capture_grads_then_step

    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    result = {"stage": engine.stage_id, "layer_range": module.layer_range, "missing_error": missing_error}
    result["eval_before"] = pipeline_logprobs(engine, data["eval_before"], mbs, with_entropy=True)
    loss = engine.train_batch(pipeline_batch_iter(data["train"], mbs, label_keys=("response_mask",)))
    result["loss"] = loss.detach().clone()
    result["metrics"] = {k: v.detach().clone() for k, v in engine.get_additional_losses().items()}
    result["eval_after"] = pipeline_logprobs(engine, data["eval_after"], mbs, with_entropy=True)
    result["grads"], result["replica_grads"] = grads, replica_grads
    export = merged_hf_state_dict(module) if lora is not None else export_hf_state_dict(module)
    result["export"] = {k: v.clone() for k, v in export.items()}
    if lora is not None:
        from rlft.pipeline.lora import adapters_disabled

        result["initial_adapter"], result["initial_export"] = initial_adapter, initial_export
        result["adapter_grads"], result["frozen_with_grad"] = adapter_grads, frozen_with_grad
        result["adapted_export"] = {k: v.clone() for k, v in merged_hf_state_dict(module, only_adapted=True).items()}
        with adapters_disabled(module):
            result["eval_base"] = pipeline_logprobs(engine, data["eval_after"], mbs, with_entropy=True)
        result["eval_again"] = pipeline_logprobs(engine, data["eval_after"], mbs, with_entropy=True)
    result["compiled_graphs"] = counters["stats"]["unique_graphs"] - graphs_before  # torch.compile's, this case
    os.makedirs(os.path.join(out_dir, case["name"]), exist_ok=True)
    torch.save(result, os.path.join(out_dir, case["name"], f"stage{engine.stage_id}.pt"))
    dist.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    torch.manual_seed(0)
    from rlft.runtime.bridge import skip_cpu_shm_comm_build

    skip_cpu_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    data = torch.load(spec["data"])
    for case in spec["cases"]:
        run_case(case, data, spec["out"])


if __name__ == "__main__":
    main()
