"""The policy as a DeepSpeed pipeline: an HF causal LM split into stages.

Layout (``L`` decoder layers, ``S`` stages, ``k = ceil(L / S)``)::

    stage 0      : embedding, decoder layers [0, k)
    stage s      : decoder layers [s*k, min((s+1)*k, L))
    stage S - 1  : its decoder layers, final norm, lm_head -> per-token log-probs

Only tensors travel between stages: ``(hidden [B,T,H] float, attention_mask [B,T] long,
input_ids [B,T] long)``. Each stage rebuilds the position ids (``cumsum(mask) - 1``, right for left
and right padding), RoPE tables and the causal+padding attention mask from the attention mask
(:class:`StageContext`), so nothing float but the hidden state has to cross a stage boundary
(DeepSpeed expects a gradient for every float tensor it sends).

The last stage never materialises more than one fp32 ``[B,T,V]`` tensor: it returns the log-prob of
each next token, ``logp[b, t] = log p(input_ids[b, t+1] | input_ids[b, :t+1])`` (``[B,T-1]``, fp32),
and, optionally, the entropy of each next-token distribution (``[B,T-1]``, fp32, detached). The
stage's output is the tuple ``(logp, entropy)``, or ``(logp,)`` without entropy; it is what the
``loss_fn(outputs, labels)`` given to :func:`build_policy_pipeline` receives.

Weights move in and out under HF names (``model.embed_tokens.weight``, ``model.layers.{i}.…``,
``model.norm.weight``, ``lm_head.weight``): :func:`load_hf_weights` reads only the tensors a stage
needs, :func:`export_hf_state_dict` gives a stage's parameters under those names, so that the stages'
exports merge into a state dict ``from_pretrained`` accepts, or stream into a sampler.
"""

from __future__ import annotations

import copy
import functools
import glob
import importlib
import json
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.utils import logger
from safetensors import safe_open

# Families whose causal LM is exactly embed -> decoder layers -> RMSNorm -> lm_head, with RoPE
# computed from position ids; others (e.g. Gemma's scaled embeddings) would silently diverge.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ATTENTION = ("eager", "sdpa")
TIED_EMBEDDING_KEY = "embed_tokens"

Batch = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


# --------------------------------------------------------------------------------------------
# Stage partition
# --------------------------------------------------------------------------------------------


def valid_stage_counts(num_layers: int) -> list[int]:
    """Stage counts for which the ``ceil(num_layers / S)`` split leaves no stage empty."""
    return [s for s in range(1, num_layers + 1) if num_layers - (s - 1) * math.ceil(num_layers / s) > 0]


def layers_per_stage(num_layers: int, num_stages: int) -> int:
    """``ceil(num_layers / num_stages)``, after checking that every stage gets a decoder layer."""
    if num_layers < 1 or num_stages < 1:
        raise ValueError(f"need at least one decoder layer and one stage, got num_layers={num_layers}, "
                         f"num_stages={num_stages}")
    per_stage = math.ceil(num_layers / num_stages)
    last = num_layers - (num_stages - 1) * per_stage
    if num_stages > num_layers or last <= 0:
        counts = [min(per_stage, max(0, num_layers - s * per_stage)) for s in range(num_stages)]
        raise ValueError(
            f"cannot split {num_layers} decoder layers into {num_stages} pipeline stages: "
            f"ceil({num_layers}/{num_stages}) = {per_stage} layers per stage gives {counts}, "
            f"leaving a stage without a decoder layer; valid stage counts for {num_layers} layers: "
            f"{valid_stage_counts(num_layers)}")
    return per_stage


def stage_layer_range(num_layers: int, num_stages: int, stage_id: int) -> tuple[int, int]:
    """Decoder layers ``[start, end)`` (global indices) held by ``stage_id``.

    >>> [stage_layer_range(7, 3, s) for s in range(3)]
    [(0, 3), (3, 6), (6, 7)]
    """
    per_stage = layers_per_stage(num_layers, num_stages)
    if not 0 <= stage_id < num_stages:
        raise ValueError(f"stage_id {stage_id} out of range for {num_stages} stages")
    start = stage_id * per_stage
    return start, min(start + per_stage, num_layers)


def _spec_boundaries(num_layers: int, num_stages: int) -> list[int]:
    """Layer-spec index boundaries (DeepSpeed's ``parts``) for the spec list of
    :func:`policy_layer_specs`: ``[embed, decoder_0 .. decoder_{L-1}, final_norm, head]``."""
    starts = [stage_layer_range(num_layers, num_stages, s)[0] for s in range(num_stages)]
    # Spec i+1 is decoder layer i; stage 0 also owns spec 0 (embedding), the last stage the
    # norm and head specs after the last decoder layer.
    return [0] + [1 + start for start in starts[1:]] + [num_layers + 3]


# --------------------------------------------------------------------------------------------
# HF model pieces
# --------------------------------------------------------------------------------------------


def _prepare_config(hf_config):
    """A private copy of the config with the attention implementation resolved and checked."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported by the policy pipeline; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    config = copy.deepcopy(hf_config)
    impl = getattr(config, "_attn_implementation", None) or "sdpa"  # HF's own default
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(f"attention implementation {impl!r} is not supported by the policy pipeline "
                         f"(it passes a 4D attention mask); use one of {SUPPORTED_ATTENTION}")
    config._attn_implementation = impl
    return config


def _hf_classes(config) -> tuple[type, type, type]:
    """``(<Prefix>DecoderLayer, <Prefix>RMSNorm, <Prefix>RotaryEmbedding)`` of the config's family."""
    modeling = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    prefix = type(config).__name__.removesuffix("Config")
    names = [prefix + suffix for suffix in ("DecoderLayer", "RMSNorm", "RotaryEmbedding")]
    missing = [n for n in names if not hasattr(modeling, n)]
    if missing:
        raise ValueError(f"{modeling.__name__} has no {', '.join(missing)}")
    return tuple(getattr(modeling, n) for n in names)


def _sliding_window(config, layer_idx: int) -> int | None:
    """Sliding-window size of one layer, or None for full attention (as the HF model decides)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # qwen2/qwen3: per-layer types
        return config.sliding_window if layer_types[layer_idx] == "sliding_attention" else None
    return getattr(config, "sliding_window", None)  # mistral: all layers or none; llama: none


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B,T]`` 0/1 mask -> ``[B,T]`` long positions counting real tokens only (pads get 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def attention_bias(attention_mask: torch.Tensor, implementation: str, dtype: torch.dtype,
                   sliding_window: int | None = None) -> torch.Tensor:
    """Causal + padding (+ sliding-window) mask ``[B,1,T,T]`` in the form HF's attention takes.

    ``attention_mask`` is ``[B,T]`` (1 = token, 0 = pad). For ``sdpa`` the result is boolean
    (True = may attend); for ``eager`` it is additive (0 or ``finfo(dtype).min``), as HF builds it.
    """
    T = attention_mask.shape[1]
    idx = torch.arange(T, device=attention_mask.device)
    allowed = idx[None, :] <= idx[:, None]  # [query, key]: key not in the future
    if sliding_window is not None:
        allowed = allowed & (idx[:, None] - idx[None, :] < sliding_window)
    allowed = allowed[None, None] & attention_mask[:, None, None, :].bool()
    if implementation == "sdpa":
        return allowed
    bias = torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device)
    return bias.masked_fill(~allowed, torch.finfo(dtype).min)


def next_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor,
                        compute_entropy: bool) -> tuple[torch.Tensor, ...]:
    """Log-probs of the observed next tokens, and optionally the entropy, from final hidden states.

    Args:
        hidden: ``[B,T,H]`` final-norm output.
        weight: ``[V,H]`` output projection (lm_head or tied embedding).
        input_ids: ``[B,T]`` long.
    Returns:
        ``(logp,)`` or ``(logp, entropy)``, each ``[B,T-1]`` fp32; entropy is detached.
    """
    logits = F.linear(hidden[:, :-1], weight)  # [B,T-1,V] in the model dtype; never kept
    # log_softmax upcasts internally and is the only fp32 [B,T-1,V] tensor autograd keeps.
    logp_all = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    del logits
    logp = logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    if not compute_entropy:
        return (logp,)
    with torch.no_grad():
        # Row by row, so the temporary p*log p is [T-1,V] rather than another [B,T-1,V].
        entropy = torch.stack([-(row.exp() * row).sum(-1) for row in logp_all])
    return logp, entropy


class EmbeddingPipe(nn.Module):
    """First stage: ``(input_ids, attention_mask)`` -> ``(hidden, attention_mask, input_ids)``.

    With tied embeddings the same module is the last stage's output projection
    (see :func:`_tied_head_forward`).
    """

    def __init__(self, config):
        super().__init__()
        # padding_idx as in the HF model: its row gets no gradient there either.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)

    @staticmethod
    def hf_name(local_name: str) -> str:
        return "model." + local_name

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]):
        input_ids, attention_mask = inputs
        return self.embed_tokens(input_ids), attention_mask, input_ids


class StageContext:
    """What the decoder layers of one stage derive from the attention mask, built once per micro-batch.

    HF builds position ids, the RoPE tables and the 4D mask once per forward and shares them across
    layers; here each stage does the same (they are never sent between stages). One instance is
    shared by all decoder layer specs, so a process holds one per stage. Entries are keyed on the
    identity of the ``[B,T]`` mask tensor, which flows unchanged from layer to layer within a stage
    (a checkpointed segment sees a detached copy and simply rebuilds them).
    """

    def __init__(self, config):
        _, _, rotary_cls = _hf_classes(config)
        # Outside any module tree, so that DeepSpeed's .bfloat16()/.half() leave RoPE's inverse
        # frequencies in fp32; it has no parameters and follows the hidden state's device.
        self.rotary = rotary_cls(config)
        self._source: torch.Tensor | None = None
        self._cache: dict = {}

    def _cached(self, attention_mask: torch.Tensor, key, make: Callable[[], object]):
        if self._source is not attention_mask:
            self._source, self._cache = attention_mask, {}
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def position_ids(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B,T]`` long."""
        return self._cached(attention_mask, "position_ids", lambda: position_ids_from_mask(attention_mask))

    def rope(self, attention_mask: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[B,T,head_dim]`` in the hidden state's dtype."""
        def make():
            if self.rotary.inv_freq.device != hidden.device:
                self.rotary.to(hidden.device)
            return self.rotary(hidden, self.position_ids(attention_mask))
        return self._cached(attention_mask, ("rope", hidden.dtype, hidden.device), make)

    def mask(self, attention_mask: torch.Tensor, implementation: str, dtype: torch.dtype,
             sliding_window: int | None) -> torch.Tensor:
        """``[B,1,T,T]``, see :func:`attention_bias`."""
        return self._cached(attention_mask, ("mask", implementation, dtype, sliding_window),
                            lambda: attention_bias(attention_mask, implementation, dtype, sliding_window))


class DecoderLayerPipe(nn.Module):
    """One HF decoder layer: ``(hidden, mask, ids)`` -> ``(hidden, mask, ids)``, hidden ``[B,T,H]``."""

    def __init__(self, config, layer_idx: int, context: StageContext):
        super().__init__()
        decoder_cls, _, _ = _hf_classes(config)
        self.layer_idx = layer_idx
        self.attn_implementation = config._attn_implementation
        self.sliding_window = _sliding_window(config, layer_idx)
        self.layer = decoder_cls(config, layer_idx)
        self.context = context  # a plain object: not a submodule, no parameters

    def hf_name(self, local_name: str) -> str:
        return f"model.layers.{self.layer_idx}." + local_name.removeprefix("layer.")

    def forward(self, inputs):
        hidden, attention_mask, input_ids = inputs
        ctx = self.context
        out = self.layer(hidden,
                         attention_mask=ctx.mask(attention_mask, self.attn_implementation, hidden.dtype,
                                                 self.sliding_window),
                         position_ids=ctx.position_ids(attention_mask),
                         position_embeddings=ctx.rope(attention_mask, hidden))
        if isinstance(out, tuple):  # transformers < 4.54 returned (hidden, ...)
            out = out[0]
        return out, attention_mask, input_ids


class FinalNormPipe(nn.Module):
    """Last stage: the model's final RMSNorm on the hidden state."""

    def __init__(self, config):
        super().__init__()
        _, norm_cls, _ = _hf_classes(config)
        self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)

    @staticmethod
    def hf_name(local_name: str) -> str:
        return "model." + local_name

    def forward(self, inputs):
        hidden, attention_mask, input_ids = inputs
        return self.norm(hidden), attention_mask, input_ids


class LMHeadPipe(nn.Module):
    """Last stage, untied: ``(hidden, mask, ids)`` -> ``(logp[, entropy])``, each ``[B,T-1]`` fp32."""

    def __init__(self, config, compute_entropy: bool = True):
        super().__init__()
        self.compute_entropy = compute_entropy
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @staticmethod
    def hf_name(local_name: str) -> str:
        return local_name

    def forward(self, inputs):
        hidden, _, input_ids = inputs
        return next_token_logprobs(hidden, self.lm_head.weight, input_ids, self.compute_entropy)


def _tied_head_forward(embedding: EmbeddingPipe, inputs, compute_entropy: bool = True):
    """Last stage, tied: the embedding matrix as output projection (``TiedLayerSpec.forward_fn``)."""
    hidden, _, input_ids = inputs
    return next_token_logprobs(hidden, embedding.embed_tokens.weight, input_ids, compute_entropy)


def policy_layer_specs(hf_config, compute_entropy: bool = True) -> list[LayerSpec]:
    """``[embedding, decoder_0 .. decoder_{L-1}, final_norm, head]`` as DeepSpeed layer specs.

    With ``tie_word_embeddings`` the embedding and the head are one ``TiedLayerSpec`` key, so
    DeepSpeed keeps the first and last stage's copies equal and all-reduces their gradients.
    """
    config = _prepare_config(hf_config)
    specs: list[LayerSpec] = []
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        specs.append(TiedLayerSpec(TIED_EMBEDDING_KEY, EmbeddingPipe, config,
                                   tied_weight_attr=["embed_tokens.weight"]))
    else:
        specs.append(LayerSpec(EmbeddingPipe, config))
    context = StageContext(config)  # shared by whichever decoder layers this process builds
    specs += [LayerSpec(DecoderLayerPipe, config, i, context) for i in range(config.num_hidden_layers)]
    specs.append(LayerSpec(FinalNormPipe, config))
    if tied:
        specs.append(TiedLayerSpec(TIED_EMBEDDING_KEY, EmbeddingPipe, config,
                                   forward_fn=functools.partial(_tied_head_forward,
                                                                compute_entropy=compute_entropy),
                                   tied_weight_attr=["embed_tokens.weight"]))
    else:
        specs.append(LayerSpec(LMHeadPipe, config, compute_entropy))
    return specs


# --------------------------------------------------------------------------------------------
# The pipeline module
# --------------------------------------------------------------------------------------------


class PolicyPipeline(PipelineModule):
    """An HF causal LM as a :class:`deepspeed.pipe.PipelineModule`, split ``ceil(L/S)`` per stage.

    Build it with :func:`build_policy_pipeline`. Extra per-step statistics: declare their names
    (``metric_names``) on every stage; the ``loss_fn`` on the last stage calls :meth:`set_metrics`
    with one scalar per name for each micro-batch; after ``engine.train_batch`` every stage reads the
    micro-batch mean from ``engine.get_additional_losses()``.
    """

    def __init__(self, hf_config, num_stages: int, loss_fn: Callable | None, *,
                 activation_checkpoint_interval: int = 0, compute_entropy: bool = True,
                 metric_names: Sequence[str] = ()):
        config = _prepare_config(hf_config)
        layers_per_stage(config.num_hidden_layers, num_stages)  # clear error before any comms
        super().__init__(layers=policy_layer_specs(config, compute_entropy), num_stages=num_stages,
                         loss_fn=loss_fn, activation_checkpoint_interval=activation_checkpoint_interval,
                         checkpointable_layers=[DecoderLayerPipe.__name__], dynamic_shape=True)
        self.hf_config = config
        self.compute_entropy = compute_entropy
        self.metric_names = tuple(metric_names)
        self._metrics: OrderedDict[str, torch.Tensor] | None = None

    def _partition_layers(self, method: str = "uniform"):
        # Called by PipelineModule.__init__. DeepSpeed's methods balance counts or parameters; the
        # policy needs the fixed ceil(L/S) split, so the boundaries are set here explicitly.
        num_layers = sum(type(s) is LayerSpec and s.typename is DecoderLayerPipe for s in self._layer_specs)
        self.parts = _spec_boundaries(num_layers, self.num_stages)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        if self.global_rank == 0:
            ranges = [stage_layer_range(num_layers, self.num_stages, s) for s in range(self.num_stages)]
            logger.info(f"policy pipeline: {num_layers} decoder layers over {self.num_stages} stages, "
                        f"decoder ranges {ranges}")
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    @property
    def layer_range(self) -> tuple[int, int]:
        """This stage's decoder layers ``[start, end)``."""
        return stage_layer_range(self.hf_config.num_hidden_layers, self.num_stages, self.stage_id)

    def set_metrics(self, metrics: Mapping[str, torch.Tensor | float]) -> None:
        """Record this micro-batch's statistics (exactly the declared ``metric_names``, scalars)."""
        if set(metrics) != set(self.metric_names):
            raise ValueError(f"set_metrics got keys {sorted(metrics)}, expected {sorted(self.metric_names)}")
        values = OrderedDict()
        for name in self.metric_names:
            value = torch.as_tensor(metrics[name]).detach().float()
            if value.numel() != 1:
                raise ValueError(f"metric {name!r} must be a scalar, got shape {tuple(value.shape)}")
            values[name] = value.reshape(())
        self._metrics = values

    def get_additional_losses(self):
        """DeepSpeed's hook: same keys in the same order on every stage (non-last stages only
        count them; the last stage's micro-batch mean is broadcast to all)."""
        if not self.metric_names:
            return None
        if self._metrics is None:
            device = next(self.parameters()).device
            return OrderedDict((name, torch.zeros((), device=device)) for name in self.metric_names)
        return self._metrics


def build_policy_pipeline(hf_config, num_stages: int, loss_fn: Callable | None, *,
                          activation_checkpoint_interval: int = 0, compute_entropy: bool = True,
                          metric_names: Sequence[str] = ()) -> PolicyPipeline:
    """Split an HF causal LM config into a :class:`PolicyPipeline` (needs torch.distributed up).

    Args:
        hf_config: a Llama/Mistral/Qwen2/Qwen3 config; ``_attn_implementation`` "eager" or "sdpa"
            (unset means "sdpa").
        num_stages: pipeline stages; must divide the world size (DeepSpeed) and leave every stage
            at least one decoder layer under the ``ceil(L/S)`` split.
        loss_fn: ``loss_fn(outputs, labels) -> scalar`` on the last stage, where ``outputs`` is
            ``(logp, entropy)`` (or ``(logp,)``), each ``[mb, T-1]``, and ``labels`` the tuple from
            :func:`pipeline_batch_iter`. DeepSpeed divides it by the number of micro-batches.
        activation_checkpoint_interval: checkpoint every n decoder layers (0 = off).
        compute_entropy: also return the per-token entropy from the last stage.
        metric_names: names of per-micro-batch scalars the loss_fn reports with ``set_metrics``.

    Parameters start randomly initialised: call :func:`load_hf_weights` before
    ``deepspeed.initialize`` (which copies them into the optimizer's master weights).
    """
    return PolicyPipeline(hf_config, num_stages, loss_fn,
                          activation_checkpoint_interval=activation_checkpoint_interval,
                          compute_entropy=compute_entropy, metric_names=metric_names)


# --------------------------------------------------------------------------------------------
# HF names in and out
# --------------------------------------------------------------------------------------------


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


@torch.no_grad()
def load_hf_weights(module: PolicyPipeline,
                    hf_state_dict_or_path: Mapping[str, torch.Tensor] | str | os.PathLike) -> None:
    """Copy this stage's weights from an HF state dict, ``.safetensors`` file or model directory.

    Only the tensors this stage holds are read. Strict: raises ``KeyError`` naming every parameter of
    this stage that the source lacks, ``ValueError`` on a shape mismatch. For tied embeddings a source
    holding only ``lm_head.weight`` serves ``model.embed_tokens.weight`` as well.
    Call it before ``deepspeed.initialize``: optimizers with master weights copy them there.
    """
    source = _WeightSource(hf_state_dict_or_path)
    tied = bool(getattr(module.hf_config, "tie_word_embeddings", False))
    missing = []
    for hf_name, param in hf_named_parameters(module, include_tied_replicas=True):
        key = hf_name
        if key not in source and tied and hf_name == "model.embed_tokens.weight":
            key = "lm_head.weight"
        if key not in source:
            missing.append(hf_name)
            continue
        tensor = source.get(key)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"{key}: checkpoint shape {tuple(tensor.shape)} != stage parameter shape "
                             f"{tuple(param.shape)}")
        param.copy_(tensor)
    if missing:
        raise KeyError(f"stage {module.stage_id}: {len(missing)} parameter(s) not found in the weights: "
                       f"{', '.join(missing)}")


def export_hf_state_dict(module: PolicyPipeline) -> dict[str, torch.Tensor]:
    """This stage's parameters under HF names (detached views of the live weights; clone to keep).

    A tied embedding is exported once, by the first stage, as ``model.embed_tokens.weight``;
    ``lm_head.weight`` appears (on the last stage) only when untied. The stages' dicts are disjoint
    and their union is the model's HF state dict.
    """
    return {name: param.detach() for name, param in hf_named_parameters(module)}


# --------------------------------------------------------------------------------------------
# Feeding the engine
# --------------------------------------------------------------------------------------------


def pipeline_batch_iter(batch: Mapping[str, torch.Tensor], micro_batch_size: int,
                        label_keys: Sequence[str] = ()) -> Iterator[Batch]:
    """Cut a batch into DeepSpeed pipeline micro-batches ``((input_ids, attention_mask), labels)``.

    Args:
        batch: ``input_ids`` and ``attention_mask`` (``[B,T]``; mask 1 = token) plus any tensors named
            in ``label_keys``, each with leading dimension ``B``.
        micro_batch_size: rows per micro-batch; must divide ``B``.
        label_keys: names of the tensors passed, in this order, as the ``labels`` tuple the
            ``loss_fn`` receives on the last stage (e.g. ``("old_logp", "advantages", "response_mask")``).
    Yields:
        ``B / micro_batch_size`` pairs; ``engine.train_batch`` consumes as many as its
        gradient-accumulation steps, so pick ``micro_batch_size = B / gradient_accumulation_steps``.
    """
    for key in ("input_ids", "attention_mask", *label_keys):
        if key not in batch:
            raise KeyError(f"batch has no {key!r} (keys: {sorted(batch)})")
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                         f"{tuple(attention_mask.shape)} must both be [B, T]")
    B = input_ids.shape[0]
    if micro_batch_size < 1 or B % micro_batch_size:
        raise ValueError(f"micro_batch_size {micro_batch_size} must divide the batch size {B}")
    for key in label_keys:
        if batch[key].shape[0] != B:
            raise ValueError(f"label {key!r} has leading size {batch[key].shape[0]}, batch size is {B}")
    input_ids, attention_mask = input_ids.long(), attention_mask.long()
    for lo in range(0, B, micro_batch_size):
        rows = slice(lo, lo + micro_batch_size)
        yield (input_ids[rows], attention_mask[rows]), tuple(batch[key][rows] for key in label_keys)


def pipeline_logprobs(engine, batch: Mapping[str, torch.Tensor], micro_batch_size: int, *,
                      with_entropy: bool = False):
    """Per-token log-probs ``[B,T-1]`` (fp32) of ``batch`` through the pipeline, without gradients.

    Every stage calls it with the same batch (at least its shape). Returns the log-probs (and the
    entropy ``[B,T-1]`` when ``with_entropy``; the module must compute it) on the last stage, None
    elsewhere. ``B`` need not be a multiple of ``micro_batch_size``: the last micro-batch is padded
    with copies of the last row, whose outputs are dropped.
    """
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    B = input_ids.shape[0]
    pad = -B % micro_batch_size
    if pad:
        input_ids = torch.cat([input_ids, input_ids[-1:].expand(pad, -1)])
        attention_mask = torch.cat([attention_mask, attention_mask[-1:].expand(pad, -1)])
    micro = list(pipeline_batch_iter({"input_ids": input_ids, "attention_mask": attention_mask},
                                     micro_batch_size))
    # eval_batch adds its outputs into total_loss, which train_batch leaves holding a scalar.
    engine.total_loss = None
    outputs = engine.eval_batch(iter(micro), compute_loss=False, reduce_output=None, bcast_loss=False,
                                num_micro_batches=len(micro))
    engine.total_loss = None
    if not engine.is_last_stage():
        return None
    logp = torch.cat([out[0] for out in outputs])[:B]
    if not with_entropy:
        return logp
    if len(outputs[0]) < 2:
        raise ValueError("with_entropy=True needs a pipeline built with compute_entropy=True")
    return logp, torch.cat([out[1] for out in outputs])[:B]
