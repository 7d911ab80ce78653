"""The run configuration's schema: one dataclass per section, with named defaults a person can
scan.  Loading and overrides: :mod:`rlft.config`; the checks across fields: :mod:`rlft.config.checks`.
Sections with modules of their own are gathered here, so that every section is found in this module:
`sampling:` (rlft/config/sampling_sections.py), `schedule:`, `topology:`, `output:`, `reporting:`
(rlft/config/run_sections.py), `teacher:`, `distill:` (rlft/config/distill_sections.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rlft.config.distill_sections import DistillConfig, TeacherConfig  # noqa: F401  (sections of RunConfig)
from rlft.config.errors import ConfigError
from rlft.config.run_sections import (  # noqa: F401  (sections of RunConfig; TRACKER_PACKAGES re-exported)
    TRACKER_PACKAGES,
    OutputConfig,
    ReportingConfig,
    ScheduleConfig,
    TopologyConfig,
)
from rlft.config.sampling_sections import SamplingConfig, engine_sections  # noqa: F401  (engine_sections: re-exported)
from rlft.data.generated import GSM_SYMBOLIC
from rlft.engines.base import check_sampling_ranges  # noqa: F401  (re-exported)
from rlft.grpo.choices import (
    DEFAULT_ADVANTAGE_ESTIMATOR,
    DEFAULT_AGGREGATION,
    DEFAULT_KL_ESTIMATOR,
    OLD_LOGPROB_SOURCES,
    OVERSAMPLE_AUTO,
    ROLLOUT_IS_MODES,
)
from rlft.data.prompts import DEFAULT_PROMPT_TEMPLATE
from rlft.models.loading import DEFAULT_MODEL
from rlft.reward.formats import DEFAULT_ANSWER_FORMAT
from rlft.reward.functions import DEFAULT_REWARD_FN

# What marks a complete checkpoint directory (written last; rlft.runtime.checkpoint.STATE_FILE).
CHECKPOINT_STATE_FILE = "trainer_state.json"

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_SYNC_MODES = ("merged", "adapter")  # model.lora.sync

@dataclass
class LoRAConfig:
    # LoRA adapters (peft) on the decoder layers' linear projections: only they are trained; the
    # reference is the base model (adapters off).
    enabled: bool = False
    rank: int = 16
    alpha: float = 32.0  # scaling = alpha / rank
    dropout: float = 0.0
    # names inside a decoder layer: its family's projections (rlft/models/families.py; phi3: qkv_proj, o_proj,
    # gate_up_proj, down_proj; mixtures of experts: the attention's)
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # What each weight sync sends the sampler: merged (the adapted projections, W + B A * alpha / rank) |
    # adapter (the adapters alone, which the vLLM engines load as a LoRA adapter; vLLM only, kept awake)
    sync: str = "merged"

    def __post_init__(self):
        if self.rank < 1:
            raise ConfigError(f"model.lora.rank: must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ConfigError(f"model.lora.alpha: must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout: must be in [0, 1), got {self.dropout}")
        if not self.target_modules or any(not isinstance(t, str) or not t for t in self.target_modules):
            raise ConfigError(f"model.lora.target_modules: must be a non-empty list of module names "
                              f"(e.g. {', '.join(LORA_TARGETS)}), got {self.target_modules!r}")
        if self.sync not in LORA_SYNC_MODES:
            raise ConfigError(f"model.lora.sync: must be one of {', '.join(LORA_SYNC_MODES)}, got {self.sync!r}")

    @property
    def adapter_sync(self) -> bool:
        """`sync: adapter` is asked for (whether LoRA is on or not)."""
        return self.sync == "adapter"

    @property
    def sends_adapters(self) -> bool:
        """Each weight sync sends the adapters alone, which the engines load as a LoRA adapter."""
        return self.enabled and self.adapter_sync

@dataclass
class ModelConfig:
    path: str = DEFAULT_MODEL  # HF hub id, local HF directory, .gguf file, or the offline default (smollm2-135m-instruct)
    dtype: str = "auto"  # auto = bf16 on GPU, fp32 on CPU
    attn_implementation: str = "sdpa"  # sdpa | eager
    activation_checkpointing: bool = False
    # torch.compile each decoder layer of the policy (the layers share one compiled graph); fuses the
    # norms, rotary embedding and activation into few kernels, at the cost of a compile in the first step.
    # The output layer's chunked log-probs run fused as well (rlft/pipeline/token_logprobs.py)
    compile_layers: bool = False
    padding_side: str = "right"  # how rollout batches are padded for the policy: right | left
    lora: LoRAConfig = field(default_factory=LoRAConfig)

@dataclass
class DataFieldsConfig:
    # Which fields of a file's or hub dataset's rows hold the question and the gold answer (rlft/data/rows.py)
    question: str = "question"
    gold: str = "answer"
    # How the gold field is read: gsm8k (the number after the last ####) | boxed (the last \boxed{} of a
    # worked solution, LaTeX kept whole: \frac{1}{2}, intervals, tuples) | plain (the field is the answer)
    gold_kind: str = "gsm8k"


@dataclass
class DifficultyConfig:
    # data.sampler: difficulty.  A prompt whose last group was all right or all wrong rests for this many
    # epochs after the one that drew it (0 = never rests) ...
    rest_epochs: int = 2
    # ... unless drawn back early: each epoch, each resting prompt returns with this probability.
    revisit_prob: float = 0.1


@dataclass
class DataConfig:
    # gsm_symbolic | reasoning_gym:TASK[?k=v&...] (generated) | openai/gsm8k or another hub id |
    # a local .jsonl/.parquet/.csv file or a directory holding {split}.jsonl/.parquet/.csv
    source: str = GSM_SYMBOLIC
    fields: DataFieldsConfig = field(default_factory=DataFieldsConfig)
    # A function of yours, package.module:function(row: dict) -> {question, gold[, solution]} or None (skip
    # the row), that maps each row instead of fields.question / fields.gold (fields.gold_kind reads its gold)
    adapter: str | None = None
    adapter_timeout_s: float | None = 10.0  # seconds data.adapter may take on one row (null: unbounded)
    hub_config: str | None = None  # a hub dataset's config (null: its default; openai/gsm8k: main)
    train_split: str = "train"
    eval_split: str = "test"
    train_size: int | None = 2000  # None = the whole split (gsm_symbolic needs a size)
    eval_size: int | None = 200
    # r1_zero (the seed's text prompt, for base models) | question_only | r1_short | a literal text with
    # {question} | chat: the tokenizer's chat template, user message = question + the answer format's
    # instruction (instruct models)
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    system_prompt: str | None = None  # chat: an optional system message
    # chat messages given literally ([{role, content}], {question} and {instruction} filled in); overrides
    # prompt_template
    prompt_messages: list[dict[str, str]] | None = None
    shuffle: bool = True
    # The order GRPO draws prompts in (rlft/data/prompt_samplers.py): uniform (each epoch a seeded permutation
    # of every row) | difficulty (pass rates kept per prompt: always-solved and never-solved prompts rest
    # for a while, see data.difficulty).  SFT draws uniformly.
    sampler: str = "uniform"
    difficulty: DifficultyConfig = field(default_factory=DifficultyConfig)

@dataclass
class GRPOConfig:
    group_size: int = 8
    loss_type: str = "grpo_clip"
    # The loss's own settings {name: value} (a registered loss's options; rlft's own losses take none)
    loss_options: dict[str, Any] = field(default_factory=dict)
    cliprange: float = 0.2
    cliprange_high: float | None = None  # DAPO clip-higher upper bound (loss_type dapo)
    advantage_eps: float = 1e-6
    advantage_estimator: str = DEFAULT_ADVANTAGE_ESTIMATOR  # grpo (÷ group std) | dr_grpo (mean only; with aggregation constant = Dr. GRPO)
    kl_coef: float = 0.0
    kl_estimator: str = DEFAULT_KL_ESTIMATOR  # k3 (unbiased, never negative) | k1 | k2
    aggregation: str = DEFAULT_AGGREGATION  # sequence (the original) | token | constant (Dr. GRPO)
    old_logprobs: str = "policy"  # policy = the weights that sampled; reference = the original's frozen model
    epochs_per_rollout: int = 1
    # Dynamic sampling: draw fresh prompts until the step holds `rollout_batch_size / group_size`
    # groups whose rewards differ (at most max_sampling_rounds rounds; then zero-variance groups fill in).
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    # Prompts a round draws (rlft/batching/round_size.py): 1.0 = as many as groups are missing; a number f
    # = f x missing; auto = enough at the keep rate of the rounds so far that a round seldom falls short
    # (at most 3x the step's).  Fewer, larger rounds: on a GPU a round lasts about its longest response.
    oversample: float | str = 1.0  # or OVERSAMPLE_AUTO
    # Sampler vs trainer log-probs.  tis = truncated importance sampling: the policy-gradient term of
    # each token x min(pi_trainer / pi_sampler, cap).
    rollout_is: str = "none"  # none | tis
    rollout_is_cap: float = 2.0
    # rollout_mismatch/* on step 1 and every N-th step after it (0 = never).  Asking the sampler for
    # log-probs slows vLLM's sampling 2.3x, so the other steps sample without them; with rollout_is: tis
    # or schedule.max_staleness > 0 the loss reads them, so every step has them and logs the metrics.
    mismatch_metrics_every: int = 10
    # Responses cut by sampling.max_tokens (DAPO): filter = no loss on them; soft_penalty = reward
    # - overlong_penalty x (how far into the last overlong_buffer tokens the response ran).
    overlong: str = "none"  # none | filter | soft_penalty
    overlong_buffer: int = 256  # tokens before max_tokens where the soft penalty starts
    overlong_penalty: float = 1.0  # the soft penalty at max_tokens
    # The token that ended a response (the model's eos / end-of-turn) is trained like the others, so the
    # policy learns when to stop (as TRL and verl do).  false = the original's mask, which leaves eos
    # and bos ids out: a chat model's end-of-turn then never gets a gradient.
    train_on_eos: bool = True

    @property
    def needs_reference(self) -> bool:
        """The frozen reference's log-probs enter the loss (KL, or old log-probs whose source is the
        reference, as the original's)."""
        return self.kl_coef > 0 or OLD_LOGPROB_SOURCES[self.old_logprobs].needs_reference

    @property
    def recomputes_old_logprobs(self) -> bool:
        """Several optimizer steps per rollout with old log-probs of the sampling policy: they are
        computed once before the first (with one step they equal the current log-probs)."""
        return self.epochs_per_rollout > 1 and OLD_LOGPROB_SOURCES[self.old_logprobs].recomputed

    def loss_reads_sampler_logprobs(self, max_staleness: int) -> bool:
        """The loss itself reads the sampler's log-probs: a rollout IS correction that reads them (tis),
        or off-policy batches whose old log-probs are the sampler's (`schedule.max_staleness` > 0)."""
        return ROLLOUT_IS_MODES[self.rollout_is].reads_sampler_logprobs or max_staleness > 0

    def wants_sampler_logprobs(self, step: int, max_staleness: int) -> bool:
        """The rollouts of `step` ask the engine for each token's log-prob: when the loss reads them,
        or on the steps that log rollout_mismatch/* (step 1 and every `mismatch_metrics_every`-th)."""
        every = self.mismatch_metrics_every
        return self.loss_reads_sampler_logprobs(max_staleness) or (every > 0 and (step - 1) % every == 0)

@dataclass
class RewardConfig:
    fn: str = DEFAULT_REWARD_FN  # the built-in grader (r1_zero_reward_fn): 1 = right format and answer
    # where the final answer is (rlft/reward/formats.py): r1_tags (the seed's <think>/<answer>) | boxed
    # (the last \boxed{}, what instruct models write) | gsm8k (a last line "#### N")
    answer_format: str = DEFAULT_ANSWER_FORMAT
    format_weight: float = 0.0  # shaping: + weight x format reward (0 = the original reward)
    timeout_s: float = 1.0  # per response: a check that takes longer scores 0 and is counted
    # none | well_formed_calls: a tool episode earns tool_reward_weight x its share of well-formed calls (ToolRL);
    # the weight stays below 1, so a correct answer never scores below a wrong one (rlft/envs/rollout_options.py)
    tool_reward: str = "none"
    tool_reward_weight: float = 0.1

@dataclass
class OptimConfig:
    lr: float = 1e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | cosine (after warm-up); records in rlft/config/lr_schedules.py
    rollout_batch_size: int = 256  # responses per step = prompts per step * group_size
    train_micro_batch_size: int = 2  # sequences per pipeline micro-batch
    # > 0: micro-batches by a token budget instead (rows sorted by length, rows x longest row <= this
    # many tokens each; see rlft/batching/micro_batches.py); 0 = train_micro_batch_size rows each.
    micro_batch_tokens: int = 0
    # A step whose loss or gradient is not finite skips its update; this many in a row stop the run
    # (exit status 1, no checkpoint of those steps, no model/ export).
    max_nonfinite_steps: int = 3
    # An update that leaves a weight non-finite or grows the parameter norm by more than this factor
    # in one step is rolled back and counts as such a step (0 = no rollback; the rollback keeps a
    # copy of the weights and optimizer state during each step).
    divergence_factor: float = 10.0

@dataclass
class SFTConfig:
    # Supervised fine-tuning (rlft.train_sft). Its step count comes from here; schedule.steps is GRPO's.
    batch_size: int = 32  # sequences per optimizer step, all data-parallel replicas together
    epochs: int = 1
    max_steps: int | None = None  # set: exactly this many steps, whatever epochs says
    max_seq_len: int = 1024  # prompt + target tokens; longer examples are skipped and counted
    train_size: int | None = None  # the first N rows of the train split (None = all of it)
    # Each target ends with the tokenizer's eos (a chat model's end-of-turn), trained: the model learns to
    # stop after its answer.  false = the original's targets, which end at the answer's last character.
    end_with_eos: bool = True
    # What becomes of the solutions' calculator annotations (<<48/2=24>>, rlft/envs/traces.py): plain (stripped) |
    # tool_calls (each a call of the environment's tool, answered by the tool; needs a multi-turn environment) |
    # plain_checked (stripped, on the rows tool_calls keeps: a single-turn arm on the same solutions)
    solution_form: str = "plain"

@dataclass
class EnvironmentConfig:
    # What a rollout is: single_turn (the run's prompt, one completion), calculator (GSM8K with a calculator
    # tool through the chat template, several turns), tools (the tools of environment.tools), a registered
    # name, or a user's module:Class (rlft.envs.base.Environment).
    name: str = "single_turn"
    options: dict = field(default_factory=dict)  # keyword arguments of the environment's constructor
    # The tools the model may call, for an environment that takes tools (tools, calculator: added to its
    # own): a registered tool's name (calculator) or module:function, a typed function whose docstring
    # says what it does and what each argument is (rlft/envs/tools.py reads its JSON schema from them).
    tools: list[str] = field(default_factory=list)
    max_turns: int = 4  # the model's turns per episode (the last one gets no tool round after it)
    # Tokens after the prompt per episode, the inserted tool replies included (null = sampling.max_tokens)
    max_episode_tokens: int | None = None
    evaluate_with_tools: bool = True  # evaluations run the same episodes; false: one turn, no tools
    # Each call of the environment (its constructor, open, step) must return within this many seconds
    # (null = unbounded), and a reply's messages hold at most this many characters (null = unbounded):
    # a call past either stops the run with one line naming the environment, the question and the rank
    step_timeout_s: float | None = 60.0
    max_reply_chars: int | None = 100_000
    # keep | filter: an episode with a turn that is neither a call nor an answer leaves the update (SimpleTIR)
    void_turns: str = "keep"
    # none | annealed: a worked tool episode before the question in a share of the training prompts falling
    # from 1 to 0 over demonstration_steps steps (rlft/envs/demonstrations.py); evaluations never show it
    demonstrations: str = "none"
    demonstration_steps: int = 50

    def episode_tokens(self, max_tokens: int) -> int:
        """The episode's budget of tokens after the prompt (`max_episode_tokens`, else `max_tokens`)."""
        return self.max_episode_tokens or max_tokens


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    reporting: ReportingConfig = field(default_factory=ReportingConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    seed: int = 0
    device: str = "auto"  # auto | cuda | cpu
    # The policy's DeepSpeed JSON (null = ds_configs/pipeline_bf16.json or pipeline_fp32.json by dtype);
    # the values the YAML also sets (micro-batch, accumulation, clipping, checkpointing) come from the YAML.
    deepspeed_config: str | None = None
    # The user's own modules (names or .py files), imported before the config is checked: they register
    # losses, answer formats, engines, roles, modes (rlft.config.plugins).
    plugins: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.teacher.path and self.topology.teacher_rank is None:
            self.topology.teacher_rank = self.topology.reference_rank  # the teacher's default place

    def to_dict(self) -> dict:
        tree = dataclasses.asdict(self)
        tree["sampling"].update({name: dataclasses.asdict(section)
                                 for name, section in self.sampling.engine_settings().items()})
        return tree

    def world_size(self) -> int:
        return self.topology.world_size()
