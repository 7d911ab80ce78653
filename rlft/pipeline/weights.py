"""Weights in and out of a pipeline stage under HF names (``model.layers.{i}.…``, ``lm_head.weight``).

Inside the stages parameters take the HF model's names; in and out they take the checkpoint's, which
are the same but for a mixture of experts' weights: the model fuses them into one ``[experts, …]``
parameter, a checkpoint (and vLLM's ``load_weights``) holds one tensor per expert and projection
(:class:`rlft.models.families.ExpertWeights`), so they are split on the way out and gathered on the
way in.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Mapping

import torch
import torch.nn as nn
from deepspeed.pipe import TiedLayerSpec
from safetensors import safe_open

from rlft.models.families import checkpoint_parts, checkpoint_tensors, renamed
from rlft.pipeline.module import PolicyPipeline
from rlft.pipeline.stages import is_tied


def _stage_layers(module: PolicyPipeline) -> Iterator[tuple[nn.Module, bool]]:
    """This stage's layer modules, each with whether it is the last stage's copy of a tied
    embedding (the first stage holds the original)."""
    seen: set[int] = set()
    for idx in range(module._local_start, module._local_stop):
        spec = module._layer_specs[idx]
        if isinstance(spec, TiedLayerSpec):
            layer, replica = module.tied_modules[spec.key], idx != 0
        else:
            layer, replica = module._modules[str(idx)], False
        if id(layer) not in seen:  # one stage holding both ends of a tie has one module
            seen.add(id(layer))
            yield layer, replica


def hf_named_parameters(module: PolicyPipeline, *, include_tied_replicas: bool = False
                        ) -> Iterator[tuple[str, nn.Parameter]]:
    """``(hf_name, parameter)`` for this stage's parameters (HF names, global layer indices).

    The last stage's copy of a tied embedding is left out unless ``include_tied_replicas``; it then
    appears as ``model.embed_tokens.weight`` too.
    """
    for layer, replica in _stage_layers(module):
        if replica and not include_tied_replicas:
            continue
        for local_name, param in layer.named_parameters():
            yield layer.hf_name(local_name), param


class _WeightSource:
    """Name -> tensor reader over a state dict, a ``.safetensors`` file or an HF directory.

    Safetensors are opened lazily: only the headers are read until a tensor is asked for.
    """

    def __init__(self, source: Mapping[str, torch.Tensor] | str | os.PathLike):
        self._dict: Mapping[str, torch.Tensor] | None = None
        self._files: dict[str, object] = {}
        self._where: dict[str, str] = {}
        if isinstance(source, Mapping):
            self._dict = source
            return
        path = os.fspath(source)
        if os.path.isfile(path):
            files = [path]
        elif os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.exists(index):
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                self._where = {name: os.path.join(path, file) for name, file in weight_map.items()}
                return
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise FileNotFoundError(f"no *.safetensors weights in {path}")
        else:
            raise FileNotFoundError(f"weights not found: {path}")
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                self._where.update((name, file) for name in f.keys())

    def __contains__(self, name: str) -> bool:
        return name in (self._dict if self._dict is not None else self._where)

    def get(self, name: str) -> torch.Tensor:
        if self._dict is not None:
            return self._dict[name]
        file = self._where[name]
        if file not in self._files:
            self._files[file] = safe_open(file, framework="pt", device="cpu")
        return self._files[file].get_tensor(name)


def _gather_experts(config, source: "_WeightSource", name: str, experts: int) -> torch.Tensor | None:
    """A fused expert parameter from a checkpoint's per-expert tensors, or None where any is missing."""
    names = checkpoint_parts(config, name, experts)
    if names is None or not all(n in source for row in names for n in row):
        return None
    return torch.stack([torch.cat([source.get(n) for n in row], dim=0) for row in names])


@torch.no_grad()
def load_hf_weights(module: PolicyPipeline,
                    hf_state_dict_or_path: Mapping[str, torch.Tensor] | str | os.PathLike) -> None:
    """Copy this stage's weights from an HF state dict, ``.safetensors`` file or model directory.

    Only the tensors this stage holds are read. Strict: raises ``KeyError`` naming every parameter of
    this stage that the source lacks, ``ValueError`` on a shape mismatch. For tied embeddings a source
    holding only ``lm_head.weight`` serves ``model.embed_tokens.weight`` as well.  Experts' weights are
    read fused (the HF model's state dict) or per expert (a checkpoint).
    Call it before ``deepspeed.initialize``: optimizers with master weights copy them there.
    """
    source = _WeightSource(hf_state_dict_or_path)
    config = module.hf_config
    tied = is_tied(config)
    missing = []
    for hf_name, param in hf_named_parameters(module, include_tied_replicas=True):
        key = hf_name
        if key not in source and tied and hf_name == "model.embed_tokens.weight":
            key = "lm_head.weight"
        if key not in source and renamed(config, key) in source:
            key = renamed(config, key)
        tensor = source.get(key) if key in source else _gather_experts(config, source, key, param.shape[0])
        if tensor is None:
            missing.append(hf_name)
            continue
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"{key}: checkpoint shape {tuple(tensor.shape)} != stage parameter shape "
                             f"{tuple(param.shape)}")
        param.copy_(tensor)
    if missing:
        raise KeyError(f"stage {module.stage_id}: {len(missing)} parameter(s) not found in the weights: "
                       f"{', '.join(missing)}")


def export_hf_state_dict(module: PolicyPipeline) -> dict[str, torch.Tensor]:
    """This stage's parameters under the checkpoint's HF names (detached views of the live weights;
    clone to keep; experts one tensor each, :func:`checkpoint_tensors`).

    A tied embedding is exported once, by the first stage, as ``model.embed_tokens.weight``;
    ``lm_head.weight`` appears (on the last stage) only when untied. The stages' dicts are disjoint
    and their union is the model's HF state dict. A stage with LoRA adapters exports through
    :func:`rlft.pipeline.lora.merged_hf_state_dict` instead (the adapted weights merged).
    """
    if getattr(module, "lora_config", None) is not None:
        raise ValueError("this stage holds LoRA adapters: export it with rlft.pipeline.lora.merged_hf_state_dict")
    return {key: tensor for name, param in hf_named_parameters(module)
            for key, tensor in checkpoint_tensors(module.hf_config, name, param.detach())}
