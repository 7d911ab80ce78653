"""What one rank holds: its config and roles, its device and the dtype its models run in."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rlft.common import log, resolve_dtype
from rlft.config import ConfigError, RunConfig
from rlft.runtime.bridge import Bridge
from rlft.config.topology import RankRoles
from rlft.config.role_records import ROLES, Role, Training

if TYPE_CHECKING:  # the role modules import DeepSpeed and transformers: only where a role is built
    from rlft.engines import RolloutEngine
    from rlft.roles.evaluator import Evaluator
    from rlft.roles.policy import PolicyTrainer
    from rlft.roles.reference import ReferenceModel
    from rlft.roles.rollout import RolloutWorker
    from rlft.roles.sft_data import SFTFeeder
    from rlft.roles.teacher import Teacher
    from rlft.runtime.reporting import Tracker


@dataclass
class RankContext:
    """Everything a rank holds, for both trainers.  A role object is None unless this rank hosts
    that role (`roles` says which: `roles.policy`, `roles.sampler`, ...) and the run builds it
    (`rlft.runtime.build.build_roles`).  Each role's object is kept in the attribute its record names
    (`rlft.config.role_records.Role.attribute`); rlft's own have typed fields below, a role of another
    module gets its attribute (None until built) when the context is made."""

    cfg: RunConfig
    roles: RankRoles
    bridge: Bridge
    device: torch.device
    model_path: str = ""  # the starting model, resolved (rank 0 converts a .gguf once)
    tokenizer: Any = None
    policy: PolicyTrainer | None = None
    rollout: RolloutWorker | None = None  # GRPO's sampler
    reference: ReferenceModel | None = None
    teacher: Teacher | None = None  # distillation's (distill.signal)
    evaluator: Evaluator | None = None
    feeder: SFTFeeder | None = None  # SFT's data, on the sampler's rank
    training: Training | None = None  # what the trainer asked of the roles (set by build_roles)
    tracker: Tracker | None = None  # rank 0 only
    best: Any = None  # rank 0 only, with output.keep_best: rlft.runtime.best_model.BestModel
    seconds: dict[str, float] = field(default_factory=dict)  # this step's time per phase
    phase_memory_gb: dict[str, float] = field(default_factory=dict)  # this step's peak GPU memory per phase
    step_peak_bytes: int = 0  # GPU: the most allocated so far (timed phases reset torch's counter)
    gpu_plan: dict[str, float] | None = None  # where the policy and an engine share this rank's GPU (memory_plan)
    gpu_budget: Any = None  # there, the engine's memory (rlft.engines.GpuBudget), from the plan
    prompt_source: Any = None  # the sampler's prompts, loaded before its engine (whose cache they size)
    sleep_auto: bool = False  # the engine's sleep setting was auto, settled by the memory plan
    sleep_hint_given: bool = False
    failed_phase: str | None = None  # the timed phase a failure left, for its message
    exit_code: int = 0  # what the rank exits with when its work returns (1: an evaluation failed, or training diverged)

    def __post_init__(self):
        for role in ROLES.values():
            if not hasattr(self, role.attribute):
                setattr(self, role.attribute, None)

    @property
    def dtype(self) -> str:
        """What this rank's engines and reference run in (`rlft.common.resolve_dtype`)."""
        return resolve_dtype(self.cfg.model.dtype, self.device.type)

    @property
    def policy_dtype(self) -> torch.dtype:
        """The pipeline trains in bfloat16 or float32 (its DeepSpeed templates)."""
        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32

    @property
    def data(self) -> RolloutWorker | SFTFeeder | None:
        """The role whose position in the training data a checkpoint keeps (the sampler's rank)."""
        return self.rollout if self.rollout is not None else self.feeder

    def role_objects(self) -> list[tuple[Role, Any]]:
        """The roles built on this rank, with their objects, in `ROLES`' order."""
        found = [(role, getattr(self, role.attribute, None)) for role in ROLES.values()]
        return [(role, obj) for role, obj in found if obj is not None]

    def state_holders(self) -> list[tuple[Role, Any]]:
        """The roles this rank hosts whose records name `state` methods, with the object holding that
        state (`Role.state_holder`: the sampler's is `data`), in `ROLES`' order."""
        found = [(role, getattr(self, role.state_holder, None)) for role in ROLES.values()
                 if role.state is not None and self.roles.hosts(role.name)]
        return [(role, obj) for role, obj in found if obj is not None]

    def engines(self) -> list[RolloutEngine]:
        """This rank's distinct engines, the sampler's first (one object when roles share it)."""
        found = [obj.engine for role, obj in self.role_objects() if role.runs_engine]
        return list({id(e): e for e in found}.values())

    def run_builds(self, name: str) -> bool:
        """Whether this run builds the role `name` (on the ranks hosting it): its record's `wanted`,
        for what the trainer asked (`training`, set by build_roles)."""
        return self.training is not None and ROLES[name].wanted(self.cfg, self.training)

    def after_step(self, step: int, metrics: dict) -> dict:
        """Call the `after_step` method of each role built here whose record names one (`Role.after_step`);
        returns the metrics they add."""
        out: dict = {}
        for role, obj in self.role_objects():
            if role.after_step:
                out.update(getattr(obj, role.after_step)(step, metrics) or {})
        return out

    @contextmanager
    def timed(self, phase: str):
        """Time `phase` (added up over the step) and, on a GPU, its peak of allocated memory.  On a
        GPU the phase ends when the work it queued there has run: its time holds its own kernels,
        not the tail of the phase before (an optimizer step still running would otherwise be
        counted in the weight sync that follows it)."""
        cuda = self.device.type == "cuda"
        if cuda:
            before = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(f"phase:{phase}"):  # a range in a profiled step's record
                yield
        except BaseException:
            self.failed_phase = self.failed_phase or phase  # the innermost phase a failure left
            raise
        finally:
            if cuda:
                torch.cuda.synchronize(self.device)
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
            if cuda:
                peak = torch.cuda.max_memory_allocated(self.device)
                self.phase_memory_gb[phase] = max(self.phase_memory_gb.get(phase, 0.0), peak / 2**30)
                self.step_peak_bytes = max(self.step_peak_bytes, before, peak)


def choose_device(cfg: RunConfig) -> torch.device:
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and os.environ.get("DS_ACCELERATOR") != "cpu"
                                         and torch.cuda.is_available())
    if not want_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device: cuda requested but no GPU is visible")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    fraction = cfg.topology.gpu_memory_fraction
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, local)
        total = torch.cuda.get_device_properties(local).total_memory / 2**30
        log.info("topology.gpu_memory_fraction: this rank's tensors may hold %.1f of the GPU's %.1f GiB",
                 fraction * total, total)
    return torch.device("cuda", local)


def peak_memory_gb(device: torch.device, ctx: RankContext | None = None) -> float:
    """The most memory this rank held: on a GPU, allocated by torch since the run started (each
    timed phase resets the counter and `ctx` keeps the maximum); on CPU, the process's peak RSS."""
    if device.type == "cuda":
        return max(torch.cuda.max_memory_allocated(device), getattr(ctx, "step_peak_bytes", 0)) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (host RSS)
