"""The policy's stages: the ``ceil(L/S)`` partition and the HF model pieces each stage runs.

Only tensors travel between stages (``(hidden, attention_mask, input_ids)``, and a mixture of experts'
routers' sums, :mod:`rlft.pipeline.router`); each stage rebuilds
position ids, RoPE tables and the 4D mask from the attention mask (:class:`StageContext`).  What
differs between decoder families (scaled embeddings, rotary tables per layer type, the final norm,
transformed logits) comes from the family's record (:mod:`rlft.models.families`); the decoder layers
are HF's own.
"""

from __future__ import annotations

import copy
import functools
import importlib
import math
from collections.abc import Callable

import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from rlft.models.families import family_of
from rlft.pipeline.router import (RouterLogits, add_router_statistics, empty_router_statistics,
                                  load_balancing_loss)
from rlft.pipeline.token_logprobs import next_token_logprobs

SUPPORTED_ATTENTION = ("eager", "sdpa")
TIED_EMBEDDING_KEY = "embed_tokens"


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


def spec_boundaries(num_layers: int, num_stages: int) -> list[int]:
    """Layer-spec index boundaries (DeepSpeed's ``parts``) for the spec list of
    :func:`policy_layer_specs`: ``[embed, decoder_0 .. decoder_{L-1}, final_norm, head]``."""
    starts = [stage_layer_range(num_layers, num_stages, s)[0] for s in range(num_stages)]
    # Spec i+1 is decoder layer i; stage 0 also owns spec 0 (embedding), the last stage the
    # norm and head specs after the last decoder layer.
    return [0] + [1 + start for start in starts[1:]] + [num_layers + 3]


# --------------------------------------------------------------------------------------------
# HF model pieces
# --------------------------------------------------------------------------------------------


def prepare_config(hf_config):
    """A private copy of the config with the attention implementation resolved and checked; raises
    ``ValueError`` (:class:`rlft.models.families.UnsupportedFamily`) for a family it cannot split."""
    family = family_of(hf_config)
    config = copy.deepcopy(hf_config)
    impl = getattr(config, "_attn_implementation", None) or "sdpa"  # HF's own default
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(f"attention implementation {impl!r} is not supported by the policy pipeline "
                         f"(it passes a 4D attention mask); use one of {SUPPORTED_ATTENTION}")
    if impl != "eager" and family.capped_attention(config):  # HF's SDPA path drops the cap without a word
        raise ValueError(f"{family.model_type} soft-caps its attention logits ({family.attention_softcap}="
                         f"{getattr(config, family.attention_softcap)}), which only eager attention applies: "
                         f"set model.attn_implementation=eager")
    config._attn_implementation = impl
    return config


def _hf_classes(config) -> tuple[type, type, type]:
    """``(<Prefix>DecoderLayer, <Prefix><norm>, <Prefix>RotaryEmbedding)`` of the config's family."""
    family = family_of(config)
    modeling = importlib.import_module(family.module_name())
    prefix = family.prefix(config)
    names = [prefix + suffix for suffix in ("DecoderLayer", family.norm_class, "RotaryEmbedding")]
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


class EmbeddingPipe(nn.Module):
    """First stage: ``(input_ids, attention_mask)`` -> ``(hidden, attention_mask, input_ids)``.

    With tied embeddings the same module is the last stage's output projection
    (see :func:`_tied_head_forward`).
    """

    def __init__(self, config, router_statistics: bool = True):
        super().__init__()
        family = family_of(config)
        # padding_idx as in the HF model: its row gets no gradient there either.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.fused_logprobs = False  # as the tied output layer; set by compile_decoder_layers
        self.scale = family.embedding_multiplier(config)
        self.scale_in_dtype = family.embedding_scale_in_dtype
        self.logit_transform = family.logit_transform(config)  # as the tied output layer
        # A mixture of experts: its routers' sums travel with the hidden state (rlft/pipeline/router.py)
        self.router_shape = family.router_shape(config) if router_statistics else None

    @staticmethod
    def hf_name(local_name: str) -> str:
        return "model." + local_name

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]):
        input_ids, attention_mask = inputs
        hidden = self.embed_tokens(input_ids)
        if self.scale is not None:  # Gemma: sqrt(hidden_size) rounded to the model's dtype; Granite: a float
            scale = torch.tensor(self.scale, device=hidden.device).to(hidden.dtype) if self.scale_in_dtype else self.scale
            hidden = hidden * scale
        if self.router_shape is not None:
            return hidden, attention_mask, input_ids, empty_router_statistics(self.router_shape[0], hidden.device)
        return hidden, attention_mask, input_ids


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
        self.per_layer_type = family_of(config).rotary_per_layer_type  # Gemma 3: local and global tables
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

    def rope(self, attention_mask: torch.Tensor, hidden: torch.Tensor,
             layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[B,T,head_dim]`` in the hidden state's dtype; with tables per layer
        type, those of ``layer_type``."""
        def make():
            buffer = next(self.rotary.buffers(), None)
            if buffer is not None and buffer.device != hidden.device:
                self.rotary.to(hidden.device)
            positions = self.position_ids(attention_mask)
            if self.per_layer_type:
                return self.rotary(hidden, positions, layer_type)
            return self.rotary(hidden, positions)
        key = ("rope", hidden.dtype, hidden.device, layer_type if self.per_layer_type else None)
        return self._cached(attention_mask, key, make)

    def mask(self, attention_mask: torch.Tensor, implementation: str, dtype: torch.dtype,
             sliding_window: int | None) -> torch.Tensor | None:
        """``[B,1,T,T]``, see :func:`attention_bias`; None where causal attention alone is exact: SDPA,
        no sliding window, and every row's tokens first with any padding after them
        (`RolloutBatch.flush_left`).  HF's SDPA attention then runs causal without a mask, which lets
        PyTorch pick its flash kernel on a GPU instead of the memory-efficient one a mask needs."""
        def make():
            if implementation == "sdpa" and sliding_window is None and self.tokens_first(attention_mask):
                return None
            return attention_bias(attention_mask, implementation, dtype, sliding_window)
        return self._cached(attention_mask, ("mask", implementation, dtype, sliding_window), make)

    def tokens_first(self, attention_mask: torch.Tensor) -> bool:
        """Whether every row is ``[1, ..., 1, 0, ..., 0]``: its first column a token, no token after a pad."""
        def make():
            m = attention_mask.bool()
            return bool(m[:, 0].all()) and not bool((m[:, 1:] & ~m[:, :-1]).any())
        return self._cached(attention_mask, "tokens_first", make)


def sdpa_backends():
    """The SDPA kernels the policy's layers may use: flash, memory-efficient and math, not cuDNN's.
    A torch profile of SFT on an H200 found cuDNN's attention spending 2.4 ms of host time on every
    call (forward and backward alike: 0.65 s a step, while the GPU waited), against about 0.1 ms for
    the memory-efficient kernel; flush-left rows (no mask) are flash attention's case anyway."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class DecoderLayerPipe(nn.Module):
    """One HF decoder layer: ``(hidden, mask, ids)`` -> ``(hidden, mask, ids)``, hidden ``[B,T,H]``."""

    def __init__(self, config, layer_idx: int, context: StageContext):
        super().__init__()
        decoder_cls, _, _ = _hf_classes(config)
        self.layer_idx = layer_idx
        self.attn_implementation = config._attn_implementation
        self.sliding_window = _sliding_window(config, layer_idx)
        layer_types = getattr(config, "layer_types", None)
        self.layer_type = layer_types[layer_idx] if layer_types else None
        self.layer = decoder_cls(config, layer_idx)
        self.context = context  # a plain object: not a submodule, no parameters
        family = family_of(config)
        try:
            router = self.layer.get_submodule(family.router) if family.router else None
        except AttributeError:  # a dense layer among the experts' (qwen3_moe's mlp_only_layers)
            router = None
        self.router_logits = RouterLogits(router) if router is not None else None
        self.router_top_k = family.router_shape(config)[1] if router is not None else 0

    def hf_name(self, local_name: str) -> str:
        return f"model.layers.{self.layer_idx}." + local_name.removeprefix("layer.")

    def forward(self, inputs):
        hidden, attention_mask, input_ids, *router_stats = inputs
        ctx = self.context
        with sdpa_backends():
            out = self.layer(hidden,
                             attention_mask=ctx.mask(attention_mask, self.attn_implementation, hidden.dtype,
                                                     self.sliding_window),
                             position_ids=ctx.position_ids(attention_mask),
                             position_embeddings=ctx.rope(attention_mask, hidden, self.layer_type))
        if isinstance(out, tuple):  # transformers < 4.54 returned (hidden, ...)
            out = out[0]
        if router_stats and self.router_logits is not None:
            router_stats = [add_router_statistics(router_stats[0], self.router_logits.take(), attention_mask,
                                                  self.router_top_k)]
        return out, attention_mask, input_ids, *router_stats


def compile_decoder_layers(module: nn.Module) -> int:
    """``torch.compile`` every decoder layer of ``module`` in place (its parameter names stay as they
    are); returns how many.  The layers run the same code, so torch compiles one graph for all of
    them (per shape class: sizes are dynamic from the start, a masked and an unmasked batch differ).
    The output layer, where ``module`` has it, computes its log-probs with fused chunks
    (``next_token_logprobs(..., fused=True)``)."""
    layers = [m.layer for m in module.modules() if isinstance(m, DecoderLayerPipe)]
    for layer in layers:
        layer.compile(dynamic=True)
    for m in module.modules():
        if isinstance(m, (LMHeadPipe, EmbeddingPipe)):  # a tied head is the embedding's module
            m.fused_logprobs = True
    return len(layers)


class FinalNormPipe(nn.Module):
    """Last stage: the model's final norm (its family's RMSNorm) on the hidden state."""

    def __init__(self, config):
        super().__init__()
        _, norm_cls, _ = _hf_classes(config)
        self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)

    @staticmethod
    def hf_name(local_name: str) -> str:
        return "model." + local_name

    def forward(self, inputs):
        hidden, attention_mask, input_ids, *router_stats = inputs
        return self.norm(hidden), attention_mask, input_ids, *router_stats


class LMHeadPipe(nn.Module):
    """Last stage, untied: ``(hidden, mask, ids)`` -> ``(logp[, entropy])``, each ``[B,T-1]`` fp32."""

    def __init__(self, config, compute_entropy: bool = True):
        super().__init__()
        self.compute_entropy = compute_entropy
        self.fused_logprobs = False  # set by compile_decoder_layers
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logit_transform = family_of(config).logit_transform(config)  # Granite's scaling, Gemma 2's cap

    @staticmethod
    def hf_name(local_name: str) -> str:
        return local_name

    def forward(self, inputs):
        hidden, _, input_ids = inputs[:3]
        out = next_token_logprobs(hidden, self.lm_head.weight, input_ids, self.compute_entropy,
                                  fused=self.fused_logprobs, logit_transform=self.logit_transform)
        return with_router_loss(out, inputs)


def _tied_head_forward(embedding: EmbeddingPipe, inputs, compute_entropy: bool = True):
    """Last stage, tied: the embedding matrix (unscaled) as output projection (``TiedLayerSpec.forward_fn``)."""
    hidden, _, input_ids = inputs[:3]
    out = next_token_logprobs(hidden, embedding.embed_tokens.weight, input_ids, compute_entropy,
                              fused=embedding.fused_logprobs, logit_transform=embedding.logit_transform)
    return with_router_loss(out, inputs)


def with_router_loss(out: tuple, inputs: tuple) -> tuple:
    """The output layer's ``(logp[, entropy])``, and last the routers' load-balancing loss where the
    stages carried their sums (a mixture of experts, :mod:`rlft.pipeline.router`)."""
    return (*out, load_balancing_loss(inputs[3])) if len(inputs) > 3 else out


def is_tied(config) -> bool:
    """Whether the config's output projection is its embedding matrix (the family's record says where
    the config tells)."""
    return bool(getattr(config, family_of(config).tied_embeddings, False))


def policy_layer_specs(hf_config, compute_entropy: bool = True, router_statistics: bool = True) -> list[LayerSpec]:
    """``[embedding, decoder_0 .. decoder_{L-1}, final_norm, head]`` as DeepSpeed layer specs.

    With ``tie_word_embeddings`` the embedding and the head are one ``TiedLayerSpec`` key, so
    DeepSpeed keeps the first and last stage's copies equal and all-reduces their gradients.
    ``router_statistics``: a mixture of experts' stages carry their routers' sums and the head returns
    the load-balancing loss last (:mod:`rlft.pipeline.router`).
    """
    config = prepare_config(hf_config)
    specs: list[LayerSpec] = []
    tied = is_tied(config)
    if tied:
        specs.append(TiedLayerSpec(TIED_EMBEDDING_KEY, EmbeddingPipe, config, router_statistics,
                                   tied_weight_attr=["embed_tokens.weight"]))
    else:
        specs.append(LayerSpec(EmbeddingPipe, config, router_statistics))
    context = StageContext(config)  # shared by whichever decoder layers this process builds
    specs += [LayerSpec(DecoderLayerPipe, config, i, context) for i in range(config.num_hidden_layers)]
    specs.append(LayerSpec(FinalNormPipe, config))
    if tied:
        specs.append(TiedLayerSpec(TIED_EMBEDDING_KEY, EmbeddingPipe, config, router_statistics,
                                   forward_fn=functools.partial(_tied_head_forward,
                                                                compute_entropy=compute_entropy),
                                   tied_weight_attr=["embed_tokens.weight"]))
    else:
        specs.append(LayerSpec(LMHeadPipe, config, compute_entropy))
    return specs
