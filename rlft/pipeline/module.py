"""The pipeline module (:class:`PolicyPipeline`) and how batches are fed to its engine."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.utils import logger

from rlft.pipeline.stages import (DecoderLayerPipe, layers_per_stage, policy_layer_specs, prepare_config,
                                  spec_boundaries, stage_layer_range)

Batch = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


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
        config = prepare_config(hf_config)
        layers_per_stage(config.num_hidden_layers, num_stages)  # clear error before any comms
        # DeepSpeed's pipeline runs backward once per float tensor a stage sends, and its activation
        # checkpoints recompute once: a mixture of experts' routers' sums travel only without them.
        super().__init__(layers=policy_layer_specs(config, compute_entropy, activation_checkpoint_interval == 0),
                         num_stages=num_stages,
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
        self.parts = spec_boundaries(num_layers, self.num_stages)
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
        hf_config: the config of a family with a record (:mod:`rlft.models.families`: llama, mistral,
            qwen2, qwen3, gemma, gemma2, gemma3_text, granite, olmo2, phi3, qwen3_moe, mixtral, a plugin's);
            ``_attn_implementation`` "eager" or "sdpa" (unset means "sdpa").
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
