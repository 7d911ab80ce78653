"""The config's sections of the run as a whole: `schedule:` (steps, evaluations, checkpoints, asynchrony),
`topology:` (which rank hosts which role, nodes, launchers), `output:` (the output directory, resuming,
checkpoints kept) and `reporting:` (trackers)."""
from __future__ import annotations

from dataclasses import dataclass, field

from rlft.config.role_records import placed_ranks

@dataclass
class ScheduleConfig:
    steps: int = 200
    evaluate_freq: int = 10  # 0 = never (the final evaluation still runs)
    evaluate_at_start: bool = False
    save_every: int = 50  # 0 = only at epoch ends and at the end
    sync_every: int = 1  # push policy weights to the sampler every N steps (and always before an evaluation)
    # Asynchronous rollouts: the sampler generates up to this many batches ahead, with the weights it
    # holds, while the policy trains (0 = strictly on-policy).  A batch is then at most this many
    # optimizer steps old; the losses take the sampler's log-probs as the sampling policy's.
    max_staleness: int = 0
    # Training time budget of one launch (null = none): the step that would end past it becomes the last
    # one (saved, exported, evaluated); launching again continues the run from there.
    time_limit_minutes: float | None = None
    log_samples_every: int = 10
    num_logged_samples: int = 4
    # Steps to run under torch's profiler (e.g. [3]): every rank writes OUT/profile/step<N>_rank<R>.txt,
    # the operators and kernels that took its time.  The profiler slows the step it watches.
    profile_steps: list[int] = field(default_factory=list)

@dataclass
class TopologyConfig:
    # Global ranks of the launch.  Policy ranks = pipeline_stages x data-parallel replicas.
    policy_ranks: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    pipeline_stages: int = 5
    sampler_rank: int = 7
    reference_rank: int = 6
    evaluator_rank: int = 5
    # The roles that have no rank key of their own (their records in rlft/config/role_records.py say so):
    # role name -> the rank that hosts it, e.g. {logger: 0}.  A role not named here runs nowhere.
    extra_roles: dict[str, int] = field(default_factory=dict)
    nodes: int = 1  # >1: launch/train.sh expects a hostfile (output.hostfile)
    # Several nodes: how DeepSpeed's launcher starts them (README, "Several nodes").  pdsh: over ssh
    # from this node; slurm, openmpi, mpich, impi, mvapich: through that launcher; no_ssh: one launch
    # per node (started by you or a scheduler), each with its topology.node_rank.
    launcher: str = "pdsh"
    launcher_args: str = ""  # extra arguments for the launcher itself (DeepSpeed's --launcher_args)
    master_addr: str | None = None  # node 0 as every node reaches it (no_ssh: required)
    master_port: int | None = None  # rank 0's store; None = a free port (one node) or 29500 (several)
    node_rank: int | None = None  # no_ssh: this node's index, set on each node's command line
    # Once training runs, the longest a rank waits on another (a collective, a silent heartbeat)
    # before the launch stops, naming the silent rank.  Start-up (loading models) is not bounded by it.
    collective_timeout_minutes: float = 10.0
    # The share of its GPU each rank's own tensors may hold (torch.cuda.set_per_process_memory_fraction):
    # past it the caching allocator gives back the blocks it keeps but does not use before it fails.
    # null = the whole GPU.  For runs that share one GPU: without a cap, the first run's cache grows
    # into what the others' engines need (a vLLM engine's memory is set apart, by the sampler's settings).
    gpu_memory_fraction: float | None = None
    # The teacher's rank (teacher.path, distill.signal); null = the reference's rank (one GPU: beside the
    # policy and the engine).  Without a teacher no rank hosts one.
    teacher_rank: int | None = None

    def world_size(self) -> int:
        """Ranks of one launch: every rank up to the highest one a role is placed on."""
        return max(placed_ranks(self)) + 1

@dataclass
class OutputConfig:
    dir: str = "runs/grpo"
    init_checkpoint: str | None = None  # None = model.path; typically the SFT output's model/ directory
    resume: str = "auto"  # auto | never | path to a checkpoint directory
    hostfile: str | None = None
    keep_checkpoints: int = 2  # newest complete checkpoints kept (0 = all)
    # Resume only the policy's weights (the checkpoint's HF export), with a fresh optimizer: for a
    # checkpoint written by another topology, whose DeepSpeed state cannot be loaded.
    resume_weights_only: bool = False
    # false: the last step writes no checkpoint and no model/ (benchmarks, throwaway runs; such a run
    # cannot be resumed from its end)
    save_at_end: bool = True
    # true: every evaluation step also saves a checkpoint, and the one whose eval/accuracy beats every
    # earlier evaluation is copied to OUT/best_model (its HF export; best.json says which step and why).
    # The evaluation split then picks the step: report a held-out figure from other data (README).
    keep_best: bool = False


# reporting.trackers' choices and the package each needs (rlft/runtime/trackers.py).
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


@dataclass
class ReportingConfig:
    # Where scalars and sample texts go besides OUT/steps.jsonl (rlft/runtime/trackers.py): any of
    # tensorboard, wandb, mlflow.
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    project: str = "rlft"  # the W&B project / MLflow experiment
    run_name: str | None = None  # None = the output directory's name
    wandb_mode: str = "offline"  # offline: OUT/wandb (`wandb sync` uploads it) | online
    mlflow_tracking_uri: str | None = None  # None = a local file store, OUT/mlruns
