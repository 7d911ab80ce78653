"""The policy role: the trainable model as a DeepSpeed pipeline on the policy ranks.

One `PolicyTrainer` lives on every policy rank.  Each holds one stage of one data-parallel replica;
`update(batch)` runs DeepSpeed's 1F1B schedule over the replica's micro-batches and steps the
optimizer, `_logprobs` runs the inference schedule.  What is optimised is the injected objective
(`rlft.objectives`: GRPO's policy-gradient loss, or SFT's NLL); it runs on the last stage.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from transformers import AutoConfig

from rlft.common import log
from rlft.batching.batch import Labels, RolloutBatch, used_width
from rlft.config import RunConfig
from rlft.batching.micro_batches import fixed_micro_batches, row_widths, token_budget_micro_batches
from rlft.models.families import family_of
from rlft.objectives import Objective
from rlft.pipeline import (build_policy_pipeline, compile_decoder_layers, export_hf_state_dict, load_hf_weights,
                           pipeline_logprobs)
from rlft.config.lr_schedules import LR_SCHEDULES
from rlft.config.role_records import reference_logprobs_by
from rlft.roles.update_guard import GuardedAdamW, SkipNonFiniteSteps  # noqa: F401 (importable from here)
from rlft.config.topology import RankRoles, check_stages_vs_layers

# DeepSpeed's JSON templates: ds_configs/ at the top of a checkout, beside launch/; an installed
# wheel carries them inside the package as rlft/ds_configs/ (setup.py maps them there).
ROUTER_METRIC = "moe/aux_loss"  # a mixture of experts' load-balancing loss, every step
PACKAGED_DS_CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"
CHECKOUT_DS_CONFIGS = Path(__file__).resolve().parents[2] / "ds_configs"


def ds_config_dir() -> Path:
    """Where the shipped DeepSpeed JSON templates are: in the package when installed, else the checkout's."""
    return PACKAGED_DS_CONFIGS if PACKAGED_DS_CONFIGS.is_dir() else CHECKOUT_DS_CONFIGS


def import_deepspeed_muon_uncompiled() -> None:
    """Import DeepSpeed's Muon optimizer module with TorchDynamo off, once, before ``deepspeed.initialize``.

    DeepSpeed's ZeRO check (``is_zero_supported_optimizer``) imports that module, which wraps three functions
    in ``torch.compile`` at import; creating those wrappers imports inductor's compiler, about 1 to 2 s of CPU
    on every policy rank of every launch.  rlft never builds a Muon optimizer, so its functions may stay
    plain: with ``TORCHDYNAMO_DISABLE=1`` set while it imports, ``torch.compile`` hands them back unwrapped.
    The variable is put back at once; ``torch.compile`` elsewhere (``model.compile_layers``) is untouched.
    """
    import os
    import sys

    if "deepspeed.runtime.zero.muon.muon_optimizer" in sys.modules:
        return
    before = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    except ImportError:  # a DeepSpeed without Muon: nothing to import
        pass
    finally:
        if before is None:
            os.environ.pop("TORCHDYNAMO_DISABLE", None)
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = before


def deepspeed_config(cfg: RunConfig, *, bf16: bool, gradient_accumulation_steps: int) -> dict:
    """The run's DeepSpeed JSON (`deepspeed_config`, or ds_configs/pipeline_<bf16|fp32>.json) with
    every value the YAML also sets taken from the YAML."""
    path = cfg.deepspeed_config or ds_config_dir() / ("pipeline_bf16.json" if bf16 else "pipeline_fp32.json")
    ds = json.loads(Path(path).expanduser().read_text())
    ds["train_micro_batch_size_per_gpu"] = cfg.optim.train_micro_batch_size
    ds["gradient_accumulation_steps"] = gradient_accumulation_steps
    ds["gradient_clipping"] = cfg.optim.grad_clip
    ds.setdefault("pipeline", {})["activation_checkpoint_interval"] = 1 if cfg.model.activation_checkpointing else 0
    return ds


def lr_lambda(cfg: RunConfig):
    warm, schedule = cfg.optim.warmup_steps, LR_SCHEDULES[cfg.optim.lr_schedule]
    total = cfg.schedule.steps

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        return schedule.factor((step - warm) / max(1, total - warm))
    return f


def apply_optimizer_settings(optimizer, scheduler, cfg, lr_factor) -> None:
    """After loading a checkpoint's optimizer and scheduler state: the config's learning rate (times
    `lr_factor(step)` of the schedule, which the config's lengths shape), betas, eps and weight decay."""
    o = cfg.optim
    scheduler.base_lrs = [o.lr for _ in optimizer.param_groups]
    for group in optimizer.param_groups:
        group.update(initial_lr=o.lr, lr=o.lr * lr_factor(scheduler.last_epoch), betas=tuple(o.betas), eps=o.eps,
                     weight_decay=o.weight_decay)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


class PolicyTrainer:
    """One stage of one replica of the policy, optimising `objective` (see `rlft.objectives`).

    `batch_size` is the number of sequences per optimizer step over all replicas; the learning-rate
    schedule spans `schedule.steps`.
    """

    def __init__(self, cfg: RunConfig, roles: RankRoles, model_path: str, device: torch.device, bf16: bool,
                 *, objective: Objective, batch_size: int, adapter_path: str | None = None):
        import deepspeed

        self.cfg, self.roles, self.device, self.bf16 = cfg, roles, device, bf16
        self.objective = objective
        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.hf_config._attn_implementation = cfg.model.attn_implementation
        check_stages_vs_layers(self.hf_config.num_hidden_layers, roles.num_stages)
        self.per_replica = batch_size // roles.num_replicas
        self.gas = self.per_replica // cfg.optim.train_micro_batch_size
        # A mixture of experts: its routers' load-balancing loss is logged, and added with the model config's
        # router_aux_loss_coef where its output_router_logits is on (rlft/pipeline/router.py); not under
        # activation checkpointing (refused at launch where it is on: rlft/config/model_family.py).
        family = family_of(self.hf_config)
        self.routed = family.router_shape(self.hf_config) is not None and not cfg.model.activation_checkpointing
        self.aux_loss_weight = family.aux_loss_weight(self.hf_config)

        module = build_policy_pipeline(
            self.hf_config, roles.num_stages, self._loss_fn,
            activation_checkpoint_interval=1 if cfg.model.activation_checkpointing else 0,
            metric_names=(*objective.metric_names, *((ROUTER_METRIC,) if self.routed else ())))
        load_hf_weights(module, model_path)
        if cfg.model.lora.enabled:  # peft's adapters: the only trainable parameters (rlft.pipeline.lora)
            from rlft.pipeline.lora import add_lora, load_adapter_weights

            add_lora(module, cfg.model.lora, seed=cfg.seed)
            if adapter_path is not None:
                load_adapter_weights(module, adapter_path)
        if cfg.model.compile_layers:
            count = compile_decoder_layers(module)
            log.info("model.compile_layers: this stage's %d decoder layers (and its output layer's chunked "
                     "log-probs, if it has the output layer) are compiled at their first use, so the first step "
                     "takes longer (about 20 s for a 1.5B model on an H200)", count)
        params = [p for p in module.parameters() if p.requires_grad]
        o = cfg.optim
        optimizer = GuardedAdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                 weight_decay=o.weight_decay, fused=device.type == "cuda",
                                 divergence_factor=o.divergence_factor)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        self.optimizer = optimizer
        import_deepspeed_muon_uncompiled()
        self.engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler,
            config=deepspeed_config(cfg, bf16=bf16, gradient_accumulation_steps=self.gas))
        self.module = self.engine.module
        self._num_tokens_total = 1.0
        self._num_micro_batches = self.gas
        self._num_rows_total = float(self.per_replica)

    # ------------------------------------------------------------------ loss (last stage)

    def _loss_fn(self, outputs, labels):
        logp, entropy = outputs[:2]
        labels = Labels.unpack(self.objective.label_fields, labels)
        loss, metrics = self.objective.loss(logp, entropy, labels, num_tokens_total=self._num_tokens_total,
                                            num_micro_batches=self._num_micro_batches,
                                            num_rows_total=self._num_rows_total)
        metrics = {k: metrics[k].reshape(()) for k in self.objective.metric_names}
        if self.routed:  # weight 0 where it is off: the routers' sums still get the gradient DeepSpeed expects
            aux = outputs[-1]
            loss = loss + self.aux_loss_weight * aux
            metrics[ROUTER_METRIC] = aux
        self.module.set_metrics(metrics)
        return loss

    # ------------------------------------------------------------------ data

    def replica_rows(self) -> slice:
        """The rows of the step's batch that this replica trains on."""
        n = self.per_replica
        return slice(self.roles.replica * n, (self.roles.replica + 1) * n)

    def micro_batch_rows(self, part: RolloutBatch) -> list[torch.Tensor]:
        """The rows of each of this replica's micro-batches: `optim.train_micro_batch_size` at a time,
        or, with `optim.micro_batch_tokens`, rows of similar length under that token budget
        (`rlft.batching.micro_batches`).  Every stage derives the same cut from the same batch."""
        o = self.cfg.optim
        if o.micro_batch_tokens:
            return token_budget_micro_batches(row_widths(part.attention_mask), o.micro_batch_tokens)
        return fixed_micro_batches(len(part), o.train_micro_batch_size)

    def _plan_micro_batches(self, part: RolloutBatch) -> list[torch.Tensor]:
        """The step's micro-batches; DeepSpeed is told their number (its gradient-accumulation steps,
        which scale every micro-batch's loss and the schedule)."""
        plan = self.micro_batch_rows(part)
        if len(plan) != self.engine.gradient_accumulation_steps():
            self.engine.set_train_batch_size(
                len(plan) * self.engine.train_micro_batch_size_per_gpu() * self.roles.num_replicas)
        self._num_micro_batches = len(plan)
        return plan

    def _micro_batches(self, part: RolloutBatch, plan: list[torch.Tensor]):
        """This replica's training micro-batches (`plan`: their rows), each cut to its own length;
        labels go to the last stage only (DeepSpeed reads them nowhere else)."""
        self._num_tokens_total = float(part.response_mask.float().sum().clamp(min=1))
        self._num_rows_total = float(len(part))
        fields = self.objective.label_fields
        labels = Labels.of(part, fields, self.objective.optional_label_fields) if self.roles.last_stage else None
        for rows in plan:
            ids, attn = part.input_ids[rows], part.attention_mask[rows]
            width = used_width(attn)
            inputs = (ids[:, :width].to(self.device), attn[:, :width].to(self.device))
            packed = labels.select(rows, width).pack(fields) if labels is not None else ()
            yield inputs, tuple(t.to(self.device) for t in packed)

    # ------------------------------------------------------------------ steps

    @property
    def reports_metrics(self) -> bool:
        """Every stage gets the step's metrics; the last stage of replica 0 reports them."""
        return self.roles.last_stage and self.roles.replica == 0

    def update(self, batch: RolloutBatch, epochs: int = 1) -> dict[str, float]:
        """`epochs` optimizer steps over this replica's rows of `batch`, after computing their old
        log-probs when the objective reads them.  Returns the last step's metrics where they are
        reported (`reports_metrics`), {} elsewhere.

        An optimizer step whose gradients are not finite is skipped (by `GuardedAdamW`, or by
        DeepSpeed's own overflow check), one whose result is not sane is rolled back
        (`rlft.roles.update_guard`): `skipped_updates` and `rolled_back_updates` count them, and
        `nonfinite` is 1 when the step's loss or gradient norm was not finite or an update was
        skipped or rolled back (the step did not change the weights soundly)."""
        # Tokens first in every row: attention then needs no padding mask, and micro-batches are as
        # wide as their longest row (the losses read rows, not columns: they are unchanged).
        part = batch.rows(self.replica_rows()).flush_left()
        if reference_logprobs_by(self.cfg, self.objective) == "policy":
            from rlft.pipeline.lora import adapters_disabled

            with adapters_disabled(self.module):  # the base model: the reference, without a second copy
                part.ref_logprobs = self._logprobs(part)  # the last stage's; None on the others
        if self.objective.needs_old_logprobs:
            part.old_logprobs = self._logprobs(part)  # the last stage's; None on the others
        skipped_before = self.optimizer.skipped + self.engine.skipped_steps
        rolled_back_before = self.optimizer.rolled_back
        finite = True
        plan = self._plan_micro_batches(part)
        for _ in range(epochs):
            metrics = self._train(part, plan)
            finite = finite and all(math.isfinite(metrics.get(k, 0.0)) for k in ("loss", "grad_norm"))
        skipped = self.optimizer.skipped + self.engine.skipped_steps - skipped_before
        for name in self.objective.unmeasured(part):
            metrics.pop(name, None)
        rolled_back = self.optimizer.rolled_back - rolled_back_before
        metrics["skipped_updates"] = float(skipped)
        metrics["rolled_back_updates"] = float(rolled_back)
        if rolled_back and self.reports_metrics:
            log.warning("the policy's update was rolled back: %s (optim.divergence_factor=%g)",
                        self.optimizer.last_rollback, self.cfg.optim.divergence_factor)
        metrics["nonfinite"] = float(skipped > 0 or rolled_back > 0 or not finite)
        return metrics if self.reports_metrics else {}

    def _train(self, part: RolloutBatch, plan: list[torch.Tensor]) -> dict[str, float]:
        """One optimizer step over this replica's rows; metrics on every stage."""
        loss = self.engine.train_batch(data_iter=self._micro_batches(part, plan))
        out = {"loss": float(loss.item()), "lr": float(self.engine.get_lr()[0])}
        norm = self.engine.get_global_grad_norm()
        if norm is not None:
            out["grad_norm"] = float(norm.item() if torch.is_tensor(norm) else norm)
        extra = self.engine.get_additional_losses() or {}
        out.update({k: float(v.item()) for k, v in extra.items()})
        return out

    @torch.no_grad()
    def _logprobs(self, part: RolloutBatch) -> torch.Tensor | None:
        """Per-token log-probs [b, T-1] of this replica's rows (last stage only; None elsewhere)."""
        lp = pipeline_logprobs(self.engine, {"input_ids": part.input_ids, "attention_mask": part.attention_mask},
                               self.cfg.optim.train_micro_batch_size)
        return None if lp is None else lp.float().cpu()

    def export_state(self) -> dict[str, torch.Tensor]:
        """This stage's weights under HF names (shared tensors are exported by one stage only);
        with LoRA, merged."""
        if self.lora:
            from rlft.pipeline.lora import merged_hf_state_dict

            return merged_hf_state_dict(self.module)
        return export_hf_state_dict(self.module)

    @property
    def lora(self) -> bool:
        return self.cfg.model.lora.enabled

    def sync_state(self, *, complete: bool = False) -> dict[str, torch.Tensor]:
        """What the engines need to hold this stage's policy: with LoRA only the weights the
        adapters change, merged (the others are the base model's, which the engines loaded at start
        and which never change), unless `complete`; else every weight."""
        if self.lora and not complete:
            from rlft.pipeline.lora import merged_hf_state_dict

            return merged_hf_state_dict(self.module, only_adapted=True)
        return self.export_state()

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """This stage's LoRA adapters under peft's names (empty without LoRA)."""
        if not self.lora:
            return {}
        from rlft.pipeline.lora import adapter_state_dict

        return adapter_state_dict(self.module)

    # ------------------------------------------------------------------ checkpoints

    def save(self, directory: str, client_state: dict) -> None:
        # With LoRA the frozen base weights stay out of DeepSpeed's files (the model path holds them).
        self.engine.save_checkpoint(directory, tag="deepspeed", client_state=client_state, save_latest=False,
                                    exclude_frozen_parameters=self.lora)

    def load(self, directory: str) -> dict:
        _, client_state = self.engine.load_checkpoint(directory, tag="deepspeed", load_optimizer_states=True,
                                                      load_lr_scheduler_states=True,
                                                      load_module_strict=not self.lora)
        if client_state is None:
            raise RuntimeError(f"could not load the policy checkpoint in {directory}/deepspeed")
        # The checkpoint brought back its learning rate and betas: this launch's config decides them.
        apply_optimizer_settings(self.optimizer, self.engine.lr_scheduler, self.cfg, lr_lambda(self.cfg))
        return client_state
