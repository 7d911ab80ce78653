"""The policy as a DeepSpeed pipeline: an HF causal LM split into stages.

Layout (``L`` decoder layers, ``S`` stages, ``k = ceil(L / S)``)::

    stage 0      : embedding, decoder layers [0, k)
    stage s      : decoder layers [s*k, min((s+1)*k, L))
    stage S - 1  : its decoder layers, final norm, lm_head -> per-token log-probs

Only tensors travel between stages: ``(hidden [B,T,H] float, attention_mask [B,T] long,
input_ids [B,T] long)``. Each stage rebuilds the position ids (``cumsum(mask) - 1``, right for left
and right padding), RoPE tables and the causal+padding attention mask from the attention mask
(:class:`StageContext`), so nothing float but the hidden state has to cross a stage boundary
(DeepSpeed expects a gradient for every float tensor it sends); a mixture of experts' stages also carry
their routers' sums ``[3, experts]`` fp32, from which the last stage returns HF's load-balancing loss after
the log-probs (:mod:`rlft.pipeline.router`; not under activation checkpointing).

The last stage never materialises an fp32 ``[B,T,V]`` tensor (the vocabulary is handled a chunk of
tokens at a time, :mod:`rlft.pipeline.token_logprobs`): it returns the log-prob of
each next token, ``logp[b, t] = log p(input_ids[b, t+1] | input_ids[b, :t+1])`` (``[B,T-1]``, fp32),
and, optionally, the entropy of each next-token distribution (``[B,T-1]``, fp32, detached). The
stage's output is the tuple ``(logp, entropy)``, or ``(logp,)`` without entropy; it is what the
``loss_fn(outputs, labels)`` given to :func:`build_policy_pipeline` receives.

Weights move in and out under HF names (``model.embed_tokens.weight``, ``model.layers.{i}.…``,
``model.norm.weight``, ``lm_head.weight``; a mixture of experts' weights one tensor per expert, as
checkpoints hold them): :func:`load_hf_weights` reads only the tensors a stage
needs, :func:`export_hf_state_dict` gives a stage's parameters under those names, so that the stages'
exports merge into a state dict ``from_pretrained`` accepts, or stream into a sampler.

What differs between decoder families (Gemma's scaled embeddings, Gemma 3's local and global rotary
tables, Granite's and Gemma 2's transformed logits, experts' weight names) comes from the family's
record, :mod:`rlft.models.families`; the decoder layers are HF's own.

Modules:

    stages.py          partition and stage layers
    token_logprobs.py  log-probs over the vocabulary in chunks
    router.py          a mixture of experts' load-balancing loss across the stages
    module.py          PolicyPipeline, feeding the DeepSpeed engine
    weights.py         HF names in and out
    lora.py            LoRA adapters on the pipeline's layers, merged for export and sync
"""

from rlft.pipeline.module import PolicyPipeline, build_policy_pipeline, pipeline_batch_iter, pipeline_logprobs
from rlft.models.families import supported_model_types
from rlft.pipeline.stages import (SUPPORTED_ATTENTION, attention_bias, compile_decoder_layers,
                                  layers_per_stage,
                                  next_token_logprobs, policy_layer_specs, position_ids_from_mask,
                                  stage_layer_range, valid_stage_counts)
from rlft.pipeline.weights import export_hf_state_dict, hf_named_parameters, load_hf_weights

__all__ = [
    "SUPPORTED_ATTENTION",
    "SUPPORTED_MODEL_TYPES",
    "supported_model_types",
    "PolicyPipeline",
    "attention_bias",
    "build_policy_pipeline",
    "compile_decoder_layers",
    "export_hf_state_dict",
    "hf_named_parameters",
    "layers_per_stage",
    "load_hf_weights",
    "next_token_logprobs",
    "pipeline_batch_iter",
    "pipeline_logprobs",
    "policy_layer_specs",
    "position_ids_from_mask",
    "stage_layer_range",
    "valid_stage_counts",
]


def __getattr__(name: str):
    """``SUPPORTED_MODEL_TYPES``: the families registered at the moment it is read (a plugin's too),
    never a list kept from import time."""
    if name == "SUPPORTED_MODEL_TYPES":
        return supported_model_types()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
