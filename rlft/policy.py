"""The policy role: the trainable model as a DeepSpeed pipeline on the policy ranks.

One `PolicyTrainer` lives on every policy rank.  Each holds one stage of one data-parallel replica;
`train(batch)` runs DeepSpeed's 1F1B schedule over the replica's micro-batches and steps the
optimizer once, `logprobs(batch)` runs the inference schedule.  The loss runs on the last stage and
calls `rlft.grpo.policy_loss` — the GRPO maths lives there, not here.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from transformers import AutoConfig

from rlft import grpo
from rlft.config import RunConfig
from rlft.pipeline import build_policy_pipeline, export_hf_state_dict, load_hf_weights, pipeline_logprobs
from rlft.topology import RankRoles, check_stages_vs_layers

DS_CONFIG_DIR = Path(__file__).resolve().parent.parent / "ds_configs"

METRIC_KEYS = ("pg_loss", "kl", "clip_fraction", "ratio_mean", "ratio_max", "entropy")


def deepspeed_config(cfg: RunConfig, *, bf16: bool, gradient_accumulation_steps: int) -> dict:
    """The JSON template from ds_configs/ with every value the YAML also sets taken from the YAML."""
    name = "pipeline_bf16.json" if bf16 else "pipeline_fp32.json"
    ds = json.loads((DS_CONFIG_DIR / name).read_text())
    ds["train_micro_batch_size_per_gpu"] = cfg.optim.train_micro_batch_size
    ds["gradient_accumulation_steps"] = gradient_accumulation_steps
    ds["gradient_clipping"] = cfg.optim.grad_clip
    ds["pipeline"]["activation_checkpoint_interval"] = 1 if cfg.model.activation_checkpointing else 0
    return ds


def lr_lambda(cfg: RunConfig, total_steps: int | None = None):
    warm, kind = cfg.optim.warmup_steps, cfg.optim.lr_schedule
    total = total_steps or cfg.schedule.steps

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if kind == "cosine":
            progress = (step - warm) / max(1, total - warm)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0
    return f


def _trim_right(*tensors: torch.Tensor, attention_mask: torch.Tensor):
    """Drop trailing columns that are padding in every row (ids/mask [b,T], per-token [b,T-1])."""
    used = int(attention_mask.any(0).nonzero().max().item()) + 1 if attention_mask.any() else 1
    used = max(used, 2)
    return [t[:, :used] if t.shape[1] == attention_mask.shape[1] else t[:, :used - 1] for t in tensors]


class PolicyTrainer:
    """objective "grpo": the policy-gradient loss; "sft": token-level NLL of the response tokens.

    `batch_size` is the number of sequences per optimizer step over all replicas (default: the
    rollout batch); `total_steps` sizes the learning-rate schedule (default: schedule.steps).
    """

    def __init__(self, cfg: RunConfig, roles: RankRoles, model_path: str, device: torch.device, bf16: bool,
                 *, objective: str = "grpo", batch_size: int | None = None, total_steps: int | None = None):
        import deepspeed

        if objective not in ("grpo", "sft"):
            raise ValueError(f"unknown objective {objective!r}")
        self.cfg, self.roles, self.device, self.bf16 = cfg, roles, device, bf16
        self.objective = objective
        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.hf_config._attn_implementation = cfg.model.attn_implementation
        check_stages_vs_layers(self.hf_config.num_hidden_layers, roles.num_stages)
        self.per_replica = (batch_size or cfg.optim.rollout_batch_size) // roles.num_replicas
        self.gas = self.per_replica // cfg.optim.train_micro_batch_size

        module = build_policy_pipeline(
            self.hf_config, roles.num_stages, self._loss_fn,
            activation_checkpoint_interval=1 if cfg.model.activation_checkpointing else 0,
            metric_names=METRIC_KEYS)
        load_hf_weights(module, model_path)
        params = [p for p in module.parameters() if p.requires_grad]
        o = cfg.optim
        optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                      weight_decay=o.weight_decay, fused=device.type == "cuda")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
        self.engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler,
            config=deepspeed_config(cfg, bf16=bf16, gradient_accumulation_steps=self.gas))
        self.module = self.engine.module
        self._num_tokens_total = 1.0

    # ------------------------------------------------------------------ loss (last stage)

    def _loss_fn(self, outputs, labels):
        logp, entropy = outputs
        mask, adv, raw, old, ref, _ = labels
        if self.objective == "sft":
            # Token-level mean NLL over the whole batch: each micro-batch contributes its token sum
            # divided by the batch's token count, times GAS because DeepSpeed divides by GAS.
            loss = -(logp * mask).sum() * self.gas / self._num_tokens_total
            self.module.set_metrics({k: torch.zeros((), device=logp.device) for k in METRIC_KEYS}
                                    | {"entropy": grpo.masked_mean(entropy.detach().float(), mask).reshape(())})
            return loss
        g = self.cfg.grpo
        if g.old_logprobs == "reference":
            old = ref
        elif g.epochs_per_rollout == 1:
            # One optimizer step per rollout: the weights that produce `logp` are the weights that
            # were synced to the sampler, so the old log-probs are exactly logp (ratio 1, same grads).
            old = logp.detach()
        loss, metrics = grpo.policy_loss(
            logp, mask, loss_type=g.loss_type, advantages=adv, raw_rewards=raw, old_log_probs=old,
            ref_log_probs=ref if g.kl_coef > 0 else None, cliprange=g.cliprange,
            cliprange_high=g.cliprange_high, kl_coef=g.kl_coef, kl_estimator=g.kl_estimator,
            aggregation=g.aggregation, constant_normalizer=float(self.cfg.sampling.max_tokens),
            num_tokens_total=self._num_tokens_total, num_micro_batches=self.gas)
        metrics = {k: metrics[k].detach().float() for k in METRIC_KEYS if k in metrics}
        metrics["entropy"] = grpo.masked_mean(entropy.detach().float(), mask)
        self.module.set_metrics({k: metrics[k].reshape(()) for k in METRIC_KEYS})
        return loss

    # ------------------------------------------------------------------ data

    def replica_rows(self) -> slice:
        """The rows of the step's batch that this replica trains on."""
        n = self.per_replica
        return slice(self.roles.replica * n, (self.roles.replica + 1) * n)

    def _micro_batches(self, batch: dict):
        """This replica's training micro-batches, each trimmed to its own length."""
        rows = self.replica_rows()
        mb = self.cfg.optim.train_micro_batch_size
        B = batch["input_ids"][rows].shape[0]
        zeros = torch.zeros_like(batch["response_mask"][rows], dtype=torch.float32)
        full = {
            "input_ids": batch["input_ids"][rows], "attention_mask": batch["attention_mask"][rows],
            "response_mask": batch["response_mask"][rows].float(),
            "advantages": batch["advantages"][rows].float() if "advantages" in batch else zeros[:, 0],
            "raw_rewards": batch["raw_rewards"][rows].float() if "raw_rewards" in batch else zeros[:, 0],
            "old_logprobs": batch["old_logprobs"][rows] if "old_logprobs" in batch else zeros,
            "ref_logprobs": batch["ref_logprobs"][rows] if "ref_logprobs" in batch else zeros,
        }
        self._num_tokens_total = float(full["response_mask"].sum().clamp(min=1))
        for i in range(0, B, mb):
            parts = [full[k][i:i + mb] for k in ("input_ids", "attention_mask", "response_mask", "old_logprobs",
                                                 "ref_logprobs")]
            ids, attn, mask, old, ref = _trim_right(*parts, attention_mask=parts[1])
            inputs = (ids.to(self.device), attn.to(self.device))
            ntok = torch.full((ids.shape[0],), self._num_tokens_total)
            labels = (mask, full["advantages"][i:i + mb], full["raw_rewards"][i:i + mb], old, ref, ntok)
            yield inputs, tuple(t.to(self.device) for t in labels)

    # ------------------------------------------------------------------ steps

    def train(self, batch: dict) -> dict[str, float]:
        """One optimizer step over this replica's share of `batch`; metrics on every stage."""
        loss = self.engine.train_batch(data_iter=self._micro_batches(batch))
        out = {"loss": float(loss.item()), "lr": float(self.engine.get_lr()[0])}
        norm = self.engine.get_global_grad_norm()
        if norm is not None:
            out["grad_norm"] = float(norm.item() if torch.is_tensor(norm) else norm)
        extra = self.engine.get_additional_losses() or {}
        out.update({k: float(v.item()) for k, v in extra.items()})
        return out

    @torch.no_grad()
    def logprobs(self, batch: dict) -> torch.Tensor | None:
        """Per-token log-probs [b, T-1] of this replica's rows (last stage only; None elsewhere)."""
        rows = self.replica_rows()
        lp = pipeline_logprobs(self.engine, {"input_ids": batch["input_ids"][rows],
                                             "attention_mask": batch["attention_mask"][rows]},
                               self.cfg.optim.train_micro_batch_size)
        return None if lp is None else lp.float().cpu()

    def export_state(self) -> dict[str, torch.Tensor]:
        """This stage's weights under HF names (shared tensors are exported by one stage only)."""
        return export_hf_state_dict(self.module)

    # ------------------------------------------------------------------ checkpoints

    def save(self, directory: str, client_state: dict) -> None:
        self.engine.save_checkpoint(directory, tag="deepspeed", client_state=client_state, save_latest=False)

    def load(self, directory: str) -> dict:
        _, client_state = self.engine.load_checkpoint(directory, tag="deepspeed", load_optimizer_states=True,
                                                      load_lr_scheduler_states=True)
        if client_state is None:
            raise RuntimeError(f"could not load the policy checkpoint in {directory}/deepspeed")
        return client_state
