"""The rollout engines as ``sampling.backend`` names them: one :class:`Backend` record per engine,
carrying what the rest of rlft needs to know about it, and the registry :data:`BACKENDS`.

The config checks, the rank start-up, the memory plan, the weight sync, the out-of-memory advice,
``rlft.evaluate`` and the bench ask the records; none of them reads an engine's own settings or
compares an engine's name.  Nothing here imports torch: ``rlft.config.launch_plan`` checks a
config (``sampling.backend`` among it) before any rank starts, without loading it.

A record registers itself when its module is imported (:func:`register_backend`): rlft's own
engines are imported by ``rlft.engines`` (in the order ``auto`` tries them); another engine's
module is named in the config's ``plugins`` and imported when the config is loaded, on every
rank and in the launch's checks (:mod:`rlft.config.plugins`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlft.engines.base import EngineSettingError, EngineUnavailable

if TYPE_CHECKING:
    from rlft.engines.base import RolloutEngine

logger = logging.getLogger(__name__)

AUTO = "auto"  # the first registered backend that is usable for the model and device


# What an engine beside the policy on one GPU needs besides its KV cache: CUDA graphs, the sampling
# activations of a batch of vLLM's default size, the CUDA context (measured on an H200: 1.5-2.5 GiB).
ENGINE_OVERHEAD_BYTES = 3 << 30
# The KV cache sized from a step holds this much more than the step's sequences need.
KV_MARGIN = 0.25
KV_BLOCK_TOKENS = 16  # a sequence's last block of the cache is partly empty


@dataclass(frozen=True)
class StepShape:
    """What one step asks of an engine on the policy's GPU: `sequences` at once, each at most
    `tokens` long (the longest prompt and the response budget), `kv_bytes_per_token` (keys and values
    of every layer), the model's `weight_bytes` and its context (`context_tokens`: one sequence that
    long must fit, as vLLM checks at start)."""

    sequences: int
    tokens: int
    kv_bytes_per_token: int
    weight_bytes: int
    context_tokens: int = 0

    @property
    def kv_bytes(self) -> int:
        """The KV cache the step needs, `KV_MARGIN` more, and never less than one whole context."""
        need = self.sequences * (self.tokens + KV_BLOCK_TOKENS) * self.kv_bytes_per_token * (1 + KV_MARGIN)
        return int(max(need, (self.context_tokens + KV_BLOCK_TOKENS) * self.kv_bytes_per_token))


@dataclass(frozen=True)
class GpuBudget:
    """An engine's memory on its GPU: `share` of it (what the memory plan counts) and, where its KV cache
    is sized from the step rather than from the share, that cache's bytes (`kv_cache_bytes`)."""

    share: float
    kv_cache_bytes: int | None = None

    def describe(self, total_bytes: int) -> str:
        gib = 2**30
        text = f"{self.share * total_bytes / gib:.1f} GiB ({self.share:.2f} of the GPU)"
        return text + (f", KV cache {self.kv_cache_bytes / gib:.1f} GiB sized from the step"
                       if self.kv_cache_bytes is not None else "")


NO_BUDGET = GpuBudget(0.0)


@dataclass(frozen=True)
class Backend:
    """A rollout engine as ``sampling.backend`` names it, with everything the launch needs to know
    about it.  The defaults describe an engine that runs in the rank's own process on the rank's
    device, takes no settings of its own, holds no fixed share of a GPU and never sleeps (HF
    ``generate``); an engine that differs overrides those methods in a subclass
    (:class:`rlft.engines.vllm_backend.VLLMBackend`).

    * ``name``: the value of ``sampling.backend`` (and ``--backend``).
    * ``engine``: ``"module:Class"`` of its :class:`~rlft.engines.base.RolloutEngine`, imported
      when one is built.
    * ``label``: how messages name it.
    * ``own_gpu_process``: the engine runs the model in a child process that takes the first
      visible GPU, so its rank must see only its own GPU before CUDA starts.
    * ``gpu_share_setting`` / ``sleep_setting``: the config keys that set its share of a GPU and
      whether it sleeps (None: it has none), for messages that say what to change.
    * ``loggers``: its libraries' loggers, kept to warnings in a rank's log.
    * ``lora_adapters``: the engine loads the policy's LoRA adapters itself (``model.lora.sync:
      adapter``: its engine takes ``update_adapter``), subject to :meth:`check_adapter_sync`.
    * ``settings``: the dataclass of its own settings (typed fields with defaults), the config's section
      ``sampling.<name>``: the config builds it when it is loaded, refusing an unknown key or a wrong
      type as in every section, and :meth:`check_settings` checks its ranges; the record reads it as
      ``cfg.sampling.<name>`` (None: the engine has no settings).
    """

    name: str
    engine: str
    label: str = ""
    own_gpu_process: bool = False
    gpu_share_setting: str | None = None
    sleep_setting: str | None = None
    loggers: tuple[str, ...] = ()
    lora_adapters: bool = False
    settings: type | None = None

    # -------------------------------------------------- before anything is built

    def installed(self) -> bool:
        """The engine's package is importable here (cheap: nothing is imported)."""
        return True

    def usable(self, model_path: str, device: str) -> tuple[bool, str]:
        """``(True, "")`` where ``auto`` may pick it for this model and device type, else ``(False, why)``."""
        return True, ""

    def refuses_family(self, family: Any) -> str | None:
        """Why the engine cannot serve models of ``family`` (a :class:`rlft.models.families.ModelFamily`),
        or None where it can."""
        return None

    def check_settings(self, sampling: Any) -> None:
        """The ranges of its own settings (``sampling.<name>``, of its ``settings`` type) in the config's
        ``sampling`` section, checked when the config is loaded, whichever engine the run names; raises
        :class:`~rlft.engines.base.EngineSettingError` naming the key."""

    def check_adapter_sync(self, cfg: Any) -> None:
        """With ``model.lora.sync: adapter``: raises :class:`~rlft.engines.base.EngineSettingError`
        (one line naming the settings) where this engine cannot take the adapters alone."""
        if not self.lora_adapters:
            able = ", ".join(r.name for r in BACKENDS.values() if r.lora_adapters) or "none registered"
            raise EngineSettingError(
                f"model.lora.sync: adapter loads the LoRA adapters into the sampler's engine, and sampling.backend "
                f"{self.name} ({self.label or self.name}) cannot take them; set sampling.backend to one that can "
                f"({able}) or model.lora.sync: merged")

    def prepare_process(self) -> None:
        """Settings the engine reads when it starts, set before anything looks at CUDA or imports
        it, in a command that may build it (``rlft.evaluate``)."""

    # -------------------------------------------------- where a rank builds one

    def check(self, cfg: Any, model_path: str, dtype: str, device_type: str) -> None:
        """Start-up checks before the engine is built for ``model_path``; raises
        :class:`~rlft.engines.base.EngineSettingError` (one line, with the settings that fix it)
        instead of the engine's own failed start."""

    def options(self, cfg: Any, device_type: str, budget: GpuBudget | None = None) -> dict:
        """The engine's keyword arguments from the run's config, on a device of ``device_type``, within
        ``budget`` where the memory plan gave it one (:meth:`gpu_budget`)."""
        return {}

    def evaluation_options(self, device_type: str, *, gpu_share: float) -> dict:
        """The engine's keyword arguments for an evaluation alone on its device (``rlft.evaluate``),
        taking ``gpu_share`` of a GPU where it holds a fixed share."""
        return {}

    def context_limit(self, cfg: Any) -> int | None:
        """The most positions (prompt and response) its settings allow (None: the model's own)."""
        return None

    def build(self, model_path: str, *, dtype: str, device: str, seed: int, tokenizer, options: dict) -> RolloutEngine:
        """The engine: ``engine``'s class with the common arguments and ``options``."""
        from rlft.common import import_object

        cls = import_object(self.engine, f"rollout backend {self.name!r}: engine", form="module:Class")
        return cls(model_path, dtype=dtype, device=device, seed=seed, tokenizer=tokenizer, **options)

    # -------------------------------------------------- memory and the weight sync

    def gpu_share(self, cfg: Any, device_type: str) -> float:
        """The fraction of a GPU the engine holds while awake as its settings give it (0: none fixed, or
        sized from the step where it shares the policy's GPU: :meth:`gpu_budget`)."""
        return 0.0

    def gpu_budget(self, cfg: Any, device_type: str, *, step: StepShape | None, total_bytes: int) -> GpuBudget:
        """The engine's memory on a GPU of ``total_bytes``: beside the policy, ``step`` says what a step
        needs (None: the engine has the GPU to itself, or serves evaluations only)."""
        return NO_BUDGET

    def sleeps(self, cfg: Any, device_type: str) -> bool:
        """The engine gives its memory back while the policy trains (between sampling and the next sync);
        with a setting of ``auto``, as settled at start (:meth:`settle_sleep`)."""
        return False

    def sleep_is_auto(self, cfg: Any) -> bool:
        """The run leaves sleeping to the memory plan (its setting is ``auto``, not yet settled)."""
        return False

    def settle_sleep(self, cfg: Any, sleeps: bool) -> None:
        """An ``auto`` sleep setting becomes ``sleeps`` (the memory plan's decision, on every rank)."""

    def sync_complete(self, cfg: Any, device_type: str) -> bool:
        """Every sync must send every weight, not only those that changed (LoRA's adapted ones):
        the engine may have dropped the others, e.g. asleep."""
        return False

    def memory_advice(self, cfg: Any) -> list[str]:
        """What in the config frees GPU memory on a rank where the engine shares the policy's GPU,
        for an out-of-memory message (one phrase each)."""
        return []


# Every registered engine, in the order ``auto`` tries them.
BACKENDS: dict[str, Backend] = {}


def register_backend(record: Backend) -> Backend:
    """Add ``record`` to :data:`BACKENDS` (after those registered before it, so ``auto`` tries it
    later); returns it.  A name may be registered once (again with an equal record: a no-op)."""
    if record.name == AUTO or not record.name:
        raise ValueError(f"a rollout backend cannot be named {record.name!r}")
    known = BACKENDS.get(record.name)
    if known is not None and known != record:
        raise ValueError(f"rollout backend {record.name!r} is registered already ({known.engine})")
    BACKENDS[record.name] = record
    return record


def backend_choices() -> tuple[str, ...]:
    """The values ``sampling.backend`` (and ``--backend``) accept."""
    return (AUTO, *BACKENDS)


def candidates(backend: str) -> list[Backend]:
    """The engines a ``sampling.backend`` value may turn into: the one it names, or for ``auto``
    every one, in the order ``auto`` tries them (what a rank must prepare for before the value
    is resolved, e.g. an engine's own GPU process)."""
    if backend not in backend_choices():
        raise ValueError(f"unknown rollout backend {backend!r}; expected one of {backend_choices()}")
    return list(BACKENDS.values()) if backend == AUTO else [BACKENDS[backend]]


def resolve_backend(backend: str, model_path: str, device: str) -> Backend:
    """The engine ``backend`` means for this model and device type (``auto``: the first usable one)."""
    choices = candidates(backend)
    if backend != AUTO:
        return choices[0]
    passed_over = []
    for choice in choices:
        usable, why = choice.usable(model_path, device)
        if usable:
            why = f" ({'; '.join(passed_over)})" if passed_over else ""
            logger.info("rollout backend auto -> %s%s", choice.name, why)
            return choice
        passed_over.append(f"{choice.name}: {why}")
    raise EngineUnavailable(f"no rollout backend is usable here: {'; '.join(passed_over)}")


def backend_record(cfg: Any) -> Backend:
    """The record of the run's engine (``cfg.sampling.backend``), which must be resolved: ``auto``
    becomes a name at start (:func:`rlft.runtime.entry.settle_backend`), before anything reads it;
    LookupError otherwise."""
    name = cfg.sampling.backend
    if name not in BACKENDS:
        raise LookupError(f"sampling.backend {name!r} is not a registered engine (auto is resolved at start)")
    return BACKENDS[name]
