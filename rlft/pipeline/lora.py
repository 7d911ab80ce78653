"""LoRA adapters inside the policy pipeline's stages (peft's LoRA layers, not hand-written ones).

:func:`add_lora` injects peft's LoRA layers into the decoder layers a stage holds, after the base
weights are loaded, and freezes everything else: only the adapters get gradients and optimizer
state. Each decoder layer's adapters are initialised from ``(seed, layer index)``, so the starting
adapters do not depend on how the layers are split into stages.

What leaves a stage:

* :func:`merged_hf_state_dict`: the stage's weights under HF names with the adapters merged in
  (``W + B A · alpha / rank``, peft's ``get_delta_weight``): the policy the sampler and the HF export
  hold. ``only_adapted=True`` gives only the projections the adapters change, and those fused with
  them in vLLM (the weight sync: the other weights are the base model's, which the engines loaded at
  start and which never change).
* :func:`adapter_state_dict`: the adapters under peft's own names
  (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``), so that
  :func:`save_adapter`'s directory opens with ``PeftModel.from_pretrained(base_model, dir)``.

:func:`adapters_disabled` runs the stage as the base model (the reference policy without a second
copy of the model).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.nn as nn

from rlft.pipeline.module import PolicyPipeline
from rlft.pipeline.stages import DecoderLayerPipe, EmbeddingPipe
from rlft.models.families import checkpoint_tensors
from rlft.pipeline.weights import _stage_layers

ADAPTER = "default"  # peft's adapter name; the one adapter of the policy
PEFT_PREFIX = "base_model.model."  # what peft puts before an HF name in a saved adapter
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_lora_config(settings):
    """``model.lora`` settings (:class:`rlft.config.schema.LoRAConfig`) -> ``peft.LoraConfig``."""
    from peft import LoraConfig

    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=list(settings.target_modules), bias="none", task_type="CAUSAL_LM")


def _decoder_layers(module: nn.Module) -> list[DecoderLayerPipe]:
    return [m for m in module.modules() if isinstance(m, DecoderLayerPipe)]


def _lora_layers(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    from peft.tuners.lora import LoraLayer

    return ((name, m) for name, m in module.named_modules() if isinstance(m, LoraLayer))


def has_lora(module: nn.Module) -> bool:
    """Whether :func:`add_lora` was applied to this stage."""
    return getattr(module, "lora_config", None) is not None


def add_lora(module: PolicyPipeline, settings, *, seed: int) -> None:
    """Inject LoRA adapters into this stage's decoder layers and freeze every other parameter.

    Call it after the base weights are loaded (:func:`rlft.pipeline.load_hf_weights`) and before
    ``deepspeed.initialize``. Raises ``ValueError`` when ``settings.target_modules`` names no linear
    layer of a decoder layer.
    """
    from peft import inject_adapter_in_model

    config = peft_lora_config(settings)
    module.requires_grad_(False)
    for layer in _decoder_layers(module):
        # The layer's own seed: the same adapters whatever the stage split.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 100_003 + layer.layer_idx)
            try:
                inject_adapter_in_model(copy.deepcopy(config), layer.layer, adapter_name=ADAPTER)
            except ValueError as e:
                raise ValueError(f"model.lora.target_modules {list(settings.target_modules)}: no such linear "
                                 f"layer in decoder layer {layer.layer_idx} ({e})") from None
        adapted = {name.rsplit(".", 1)[-1] for name, _ in _lora_layers(layer.layer)}
        missing = [t for t in settings.target_modules if t not in adapted]
        if missing:  # peft adapts the names it finds and says nothing of the others
            raise ValueError(f"model.lora.target_modules: {', '.join(map(repr, missing))} names no linear layer in "
                             f"decoder layer {layer.layer_idx}")
        if hasattr(layer.layer, "peft_config"):  # peft leaves its config on the module; not a weight
            del layer.layer.peft_config
    for embedding in [m for m in module.modules() if isinstance(m, EmbeddingPipe)]:
        embedding.register_forward_hook(_hidden_requires_grad)
    module.lora_config = config
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    if any(".lora_" not in n for n in trainable):
        raise RuntimeError(f"LoRA left non-adapter parameters trainable: {[n for n in trainable if '.lora_' not in n]}")


def _hidden_requires_grad(_module, _inputs, outputs):
    """The frozen embedding's output carries no gradient; a checkpointed decoder layer (DeepSpeed's
    activation checkpointing) whose inputs need none would leave its adapters without one."""
    hidden, *rest = outputs
    if torch.is_grad_enabled() and not hidden.requires_grad:
        hidden = hidden.requires_grad_(True)
    return (hidden, *rest)


@contextlib.contextmanager
def adapters_disabled(module: nn.Module):
    """Run the stage as the base model: every LoRA layer passes its input to the base layer only."""
    layers = [m for _, m in _lora_layers(module)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


def _base_name(local_name: str) -> str:
    """``layer.self_attn.q_proj.base_layer.weight`` -> ``layer.self_attn.q_proj.weight``."""
    return local_name.replace(".base_layer.", ".")


# Projections vLLM fuses into one layer (qkv_proj, gate_up_proj): its in-place reload keeps the
# previous weights of a fused layer that received only some of its parts, so they travel together.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _sent_with(module_name: str) -> set[str]:
    """``layer.self_attn.q_proj`` -> itself and the projections fused with it."""
    owner, _, leaf = module_name.rpartition(".")
    group = next((g for g in FUSED if leaf in g), (leaf,))
    return {f"{owner}.{m}" if owner else m for m in group}


@torch.no_grad()
def merged_hf_state_dict(module: PolicyPipeline, *, only_adapted: bool = False) -> dict[str, torch.Tensor]:
    """This stage's weights under HF names, adapters merged in (see the module docstring).

    Unadapted weights are detached views of the live (frozen) weights; merged ones are new tensors
    in the weights' dtype. As :func:`rlft.pipeline.export_hf_state_dict` (which a stage with
    adapters refuses), a tied embedding is given once, by the first stage. ``only_adapted``: only
    the parameters (weights and biases) of the adapted projections and of those an engine fuses
    with them (:data:`FUSED`), everything the weight sync must send.
    """
    out: dict[str, torch.Tensor] = {}
    for layer, replica in _stage_layers(module):
        if replica:
            continue
        merged, sent = {}, set()
        for name, lora in _lora_layers(layer):
            base = lora.get_base_layer().weight
            merged[f"{name}.weight"] = (base + lora.get_delta_weight(ADAPTER).to(base.dtype)).detach()
            sent |= _sent_with(name)
        for local_name, param in layer.named_parameters():
            if ".lora_" in local_name:
                continue
            name = _base_name(local_name)
            if only_adapted and name.rpartition(".")[0] not in sent:
                continue
            out.update(checkpoint_tensors(module.hf_config, layer.hf_name(name), merged.get(name, param.detach())))
    return out


def adapter_named_parameters(module: PolicyPipeline) -> Iterator[tuple[str, nn.Parameter]]:
    """``(peft name, parameter)`` of this stage's adapters, e.g.
    ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``."""
    for layer, replica in _stage_layers(module):
        if replica:
            continue
        for local_name, param in layer.named_parameters():
            if ".lora_" in local_name:
                yield PEFT_PREFIX + layer.hf_name(local_name).replace(f".{ADAPTER}.", "."), param


def adapter_state_dict(module: PolicyPipeline) -> dict[str, torch.Tensor]:
    """This stage's adapters under peft's names (detached views; the stages' dicts are disjoint)."""
    return {name: p.detach() for name, p in adapter_named_parameters(module)}


@torch.no_grad()
def load_adapter_weights(module: PolicyPipeline, state: Mapping[str, torch.Tensor] | str | Path) -> None:
    """Copy this stage's adapters from a peft adapter state dict or directory (strict: every adapter
    of the stage must be there, with its shape)."""
    if not isinstance(state, Mapping):
        from safetensors.torch import load_file

        state = load_file(str(Path(state) / ADAPTER_WEIGHTS))
    missing = []
    for name, param in adapter_named_parameters(module):
        if name not in state:
            missing.append(name)
            continue
        if tuple(state[name].shape) != tuple(param.shape):
            raise ValueError(f"{name}: adapter shape {tuple(state[name].shape)} != {tuple(param.shape)}")
        param.copy_(state[name])
    if missing:
        raise KeyError(f"stage {module.stage_id}: {len(missing)} adapter weight(s) not found: {', '.join(missing)}")


def save_adapter(directory: str | Path, state: Mapping[str, torch.Tensor], config,
                 base_model: str | None = None) -> None:
    """Write a peft adapter directory (``adapter_model.safetensors`` + ``adapter_config.json``)
    from the union of the stages' :func:`adapter_state_dict`; ``config`` is the ``peft.LoraConfig``."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = copy.deepcopy(config)
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(directory))
