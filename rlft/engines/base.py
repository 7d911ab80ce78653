"""The rollout-engine interface shared by the HF ``generate`` and vLLM samplers.

A rollout engine turns prompts (token ids) into sampled completions (token ids) and can have
its weights replaced in place by the trainer between steps. Prompts go in as token ids and
responses come back as token ids so that the trainer never re-tokenises text: the ids it
scores are exactly the ids that were sampled.
"""

from __future__ import annotations

import logging
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from rlft.common import FINISH_REASONS  # noqa: F401 (why a response ended, spelled once)

# torch is imported by the functions that use it: rlft.engines' records (`BACKENDS`), which the launch's
# config checks read, load without it.
if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    """The requested backend cannot be used here (not installed, unsupported version, ...)."""


class EngineSettingError(ValueError):
    """A setting of an engine's that cannot work (its record's checks); the message names the key.
    The config and the rank start-up report it as a config error."""


# The sampling parameters' ranges, checked in one place for the config (sampling.*), the engines
# (SamplingSpec below, whose defaults are the config's sampling.*) and python -m rlft.evaluate.
SAMPLING_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "temperature": (lambda v: v >= 0, "must be >= 0"),
    "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "max_tokens": (lambda v: v >= 1, "must be >= 1"),
    "repetition_penalty": (lambda v: v > 0, "must be > 0"),
    "n": (lambda v: v >= 1, "must be >= 1"),
}


def check_sampling_ranges(values: dict[str, float], label: Callable[[str], str] = str) -> None:
    """Raise ``ValueError("<label(name)>: <rule>, got <value>")`` for the first value out of its
    range; ``min_tokens`` must lie between 0 and ``max_tokens`` when both are given.  ``values`` are
    keyed by the parameter's name (:data:`SAMPLING_RANGES`); ``label`` names it as the caller's
    user knows it (``sampling.top_p``, ``--top-p``)."""
    for name, value in values.items():
        if name == "min_tokens":
            top = values.get("max_tokens")
            if not 0 <= value <= (value if top is None else top):
                raise ValueError(f"{label(name)}: must be between 0 and {label('max_tokens')} ({top}), got {value}")
            continue
        ok, rule = SAMPLING_RANGES[name]
        if not ok(value):
            raise ValueError(f"{label(name)}: {rule}, got {value}")



@dataclass
class SamplingSpec:
    """Sampling parameters, with vLLM's semantics on every backend.

    * ``temperature == 0`` means greedy decoding (``top_p`` and ``seed`` are then irrelevant).
    * ``min_tokens``: neither eos nor a stop string can end a completion before this many
      tokens were generated (a stop string counts only if it is completed by token number
      ``min_tokens + 1`` or later).
    * ``stop``: generation ends at the token that completes the first occurrence of a stop
      string; that token is the last of ``Completion.token_ids``. ``include_stop_str_in_output``
      only changes ``Completion.text`` (cut after, or before, the stop string).
    * ``repetition_penalty``: logits of every token present in the prompt or the response so
      far are divided by it when positive and multiplied by it when negative.
    * ``seed``: completion ``j`` of prompt ``i`` uses seed ``seed + i * n + j`` on vLLM; the HF
      backend seeds the whole call with ``seed``. ``None`` draws from the engine's own stream.
    * ``logprobs``: return each sampled token's log-prob (``Completion.logprobs``), see there.
    """

    # The defaults of the config's sampling.* too (rlft.config.schema.SamplingConfig reads them here).
    temperature: float = 1.0
    top_p: float = 1.0
    min_tokens: int = 4
    max_tokens: int = 1024
    # The config leaves stop to the answer format; the engines' default is the default format's (r1_tags).
    stop: list[str] = field(default_factory=lambda: ["</answer>"])
    include_stop_str_in_output: bool = True
    repetition_penalty: float = 1.1
    n: int = 1
    seed: int | None = None
    logprobs: bool = True

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first out-of-range field."""
        check_sampling_ranges({"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens,
                               "min_tokens": self.min_tokens, "repetition_penalty": self.repetition_penalty,
                               "n": self.n}, label=lambda name: f"SamplingSpec.{name}")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"SamplingSpec.stop must be a list of non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_spec(cfg, *, n: int, seed: int | None, evaluation: bool = False,
                  logprobs: bool = False) -> SamplingSpec:
    """The engine's sampling parameters from the run's `sampling` section (`rlft.config.schema.SamplingConfig`;
    evaluation: greedy by default);
    `logprobs`: ask for each sampled token's log-prob (it slows vLLM's sampling 2.3x, so only where read)."""
    return SamplingSpec(
        temperature=cfg.eval_temperature if evaluation else cfg.temperature,
        top_p=1.0 if evaluation and cfg.eval_temperature == 0 else cfg.top_p,
        min_tokens=cfg.min_tokens,
        max_tokens=(cfg.eval_max_tokens or cfg.max_tokens) if evaluation else cfg.max_tokens,
        stop=list(cfg.stop), include_stop_str_in_output=cfg.include_stop_str_in_output,
        repetition_penalty=cfg.repetition_penalty, n=n, seed=seed,
        logprobs=logprobs and not evaluation)


@dataclass
class Completion:
    """One sampled response.

    ``token_ids`` are the generated ids only (no prompt). They end with the eos id when the
    model stopped on eos (``finish_reason == "eos"``), or with the token that completed a
    stop string (``"stop"``); ``"length"`` means ``max_tokens`` ran out. ``text`` is the
    detokenised response without special tokens, cut at the stop string.

    ``logprobs`` (when ``SamplingSpec.logprobs``; else None) holds, for each of ``token_ids``, its
    log-prob under the engine's **raw** next-token distribution: ``log_softmax`` of the model's
    logits at temperature 1, before the repetition penalty, temperature, top-p and ``min_tokens``
    shape the distribution that was actually sampled from (vLLM's default ``logprobs_mode``,
    ``raw_logprobs``). That is the trainer's own definition of a token's log-prob, so the two can
    be compared directly: whatever differs is the engines' numerics (kernels, dtype, batching) or
    weights that are not yet synced, never the sampling settings.
    """

    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None = None


class RolloutEngine(ABC):
    """A sampler whose weights the trainer can replace in place.

    ``continuous_turns``: the engine also has ``generate_continuous(prompt_token_ids, spec, follow)``, which
    takes each multi-turn episode's next turn as soon as its environment has answered (vLLM); without it
    an episode's turns go turn by turn, every live episode's turn in one ``generate`` call."""

    continuous_turns: bool = False

    @abstractmethod
    def generate(self, prompt_token_ids: list[list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        """Sample ``spec.n`` completions for each prompt.

        Args:
            prompt_token_ids: ``P`` prompts, each a non-empty list of token ids.
            spec: sampling parameters.
        Returns:
            ``P`` lists of ``spec.n`` completions, in prompt order.
        """

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace weights by HF parameter name (``model.layers.0.self_attn.q_proj.weight``...).

        ``named_tensors`` may be a lazy stream (e.g. one pipeline stage at a time) and may
        cover only part of the model. ``lm_head.weight`` may be left out when the embeddings
        are tied. Unknown names or wrong shapes raise ``ValueError``. When the call returns,
        ``generate`` sees all of the new weights.
        """

    @abstractmethod
    def weights_checksum(self) -> dict[str, float]:
        """Name-independent checksum of the weights that ``generate`` uses.

        ``{"sum": sum of all elements, "abs_sum": sum of absolute values}``, both in float64
        over every distinct parameter (a tied embedding counts once). Both numbers are
        unchanged by concatenating tensors, so vLLM's fused ``qkv_proj``/``gate_up_proj``
        give the same values as HF's separate projections; compare with
        :func:`named_weights_checksum` of the source weights cast to the engine's dtype.
        """

    @property
    def sleeps(self) -> bool:
        """The engine was built to give its memory back between uses (its record's ``sleeps``): its
        users put it to sleep after sampling, and it wakes for the next sync."""
        return False

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory while another role uses the device (no-op by default).  Level 1
        keeps the weights (in host memory); level 2 drops them: only for an engine whose weights
        are all replaced (`update_weights`) before it generates again."""

    def wake(self) -> None:
        """Undo :meth:`sleep` (no-op by default)."""

    # ---------------------------------------------- LoRA adapters (``model.lora.sync: adapter``)
    # Only an engine built to load adapters (its record's ``lora_adapters``, e.g. vLLM's) overrides these.

    @property
    def takes_adapters(self) -> bool:
        """The engine was built to load the policy's LoRA adapters (the methods below)."""
        return False

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take one part of the policy's LoRA adapters (peft's names, one pipeline stage's); nothing is
        loaded until :meth:`finish_adapter_update`."""
        raise NotImplementedError(f"{type(self).__name__} does not load LoRA adapters")

    def finish_adapter_update(self) -> None:
        """Load the parts given since the last call as the adapter every ``generate`` uses from now on,
        in place of the previous one."""
        raise NotImplementedError(f"{type(self).__name__} does not load LoRA adapters")

    def adapter_checksum(self) -> dict[str, float]:
        """:func:`adapter_weights_checksum` of the adapter the engine computes with (as it holds it)."""
        raise NotImplementedError(f"{type(self).__name__} does not load LoRA adapters")

    def close(self) -> None:
        """Release the engine's resources (no-op by default)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def weights_checksum_of(tensors: Iterable[torch.Tensor]) -> dict[str, float]:
    """``{"sum", "abs_sum"}`` of the given tensors, in float64 (see
    :meth:`RolloutEngine.weights_checksum`). Callers pass each distinct tensor once.

    A 16-bit tensor is summed in blocks of up to 1024 elements in float32 first, and only the block
    sums are added in float64: a float64 sum of a 16-bit tensor casts all of it to float64 first (a
    1.5B model's 3 GB of bf16 weights became 12 GB written and read, twice, on each side of every
    sync), while torch reduces 16-bit floats into float32 as they are.  Blocks of the same values
    give the same block sums, so a fused layout of the same weights (vLLM's ``qkv_proj``, whose parts
    are multiples of 1024 elements) agrees to float64 rounding; another order (a transposed layout)
    moves the float32 block sums' rounding by well under 1e-9 of the absolute sum (2e-10 for random
    bf16 weights of a 1.5B model's layer shapes), far inside a sync's tolerance.  Other dtypes are
    summed in float64 as they are.

    The sums stay on each tensor's device until the end: one host round trip per device rather
    than two per tensor (hundreds of GPU synchronisations for a model of a few hundred tensors).
    """
    import torch

    blocks: dict = {}  # device -> ([float32 block sums], [float32 block sums of |x|]) of the 16-bit tensors
    scalars: dict = {}  # device -> float64 scalars of the others: [sum, abs_sum, sum, abs_sum, ...]
    with torch.no_grad():
        for t in tensors:
            t = t.detach()
            if t.dtype in (torch.bfloat16, torch.float16) and t.numel():
                rows = t.reshape(-1, math.gcd(t.numel(), 1024))
                sums, abs_sums = blocks.setdefault(t.device, ([], []))
                sums.append(rows.sum(1, dtype=torch.float32))
                abs_sums.append(rows.abs().sum(1, dtype=torch.float32))
            else:
                scalars.setdefault(t.device, []).extend((t.sum(dtype=torch.float64), t.abs().sum(dtype=torch.float64)))
    total = total_abs = 0.0
    for device in {*blocks, *scalars}:
        parts = [torch.cat(b).sum(dtype=torch.float64) for b in blocks.get(device, ())] + scalars.get(device, [])
        s, a = torch.stack(parts).view(-1, 2).sum(0).tolist()
        total += s
        total_abs += a
    return {"sum": total, "abs_sum": total_abs}


def named_weights_checksum(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Checksum of HF-named weights, comparable with :meth:`RolloutEngine.weights_checksum`.

    A state dict of a tied model holds the embedding twice (``model.embed_tokens.weight``
    and ``lm_head.weight``) while engines count it once, so with ``tie_word_embeddings``
    ``lm_head.weight`` is skipped. ``dtype`` casts each tensor first (e.g. fp32 trainer
    weights against a bf16 engine).
    """
    tensors = (
        t.to(dtype) if dtype is not None else t
        for name, t in named_tensors
        if not (tie_word_embeddings and name == "lm_head.weight")
    )
    return weights_checksum_of(tensors)


def adapter_weights_checksum(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    scaling: float,
    dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """``{"sum", "abs_sum"}`` of LoRA adapters under peft's names, as an engine computes with them: each
    ``lora_A`` as it is and each ``lora_B`` times ``scaling`` (alpha / rank), the scaling folded into B
    (vLLM's ``LoRALayerWeights.optimize``), each first cast to ``dtype`` (the engine's) and multiplied in
    it, so the same arithmetic gives the same values on both sides of a sync."""
    def tensors():
        for name, t in named_tensors:
            t = t.detach() if dtype is None else t.detach().to(dtype)
            yield t * scaling if ".lora_B." in name and scaling != 1 else t

    return weights_checksum_of(tensors())


def restrict_to_device(local_gpu_index: int) -> str:
    """Make only GPU ``local_gpu_index`` visible to this process (and its children).

    Must run before CUDA is initialised: vLLM's engine process inherits
    ``CUDA_VISIBLE_DEVICES`` and uses its first visible device. An index into an already
    restricted list (``CUDA_VISIBLE_DEVICES=4,5,6,7``) selects from that list.

    Returns:
        the new value of ``CUDA_VISIBLE_DEVICES``.
    """
    import torch

    if local_gpu_index < 0:
        raise ValueError(f"local_gpu_index must be >= 0, got {local_gpu_index}")
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "restrict_to_device() called after CUDA was initialised in this process; "
            "call it before any CUDA work (and before creating the vLLM engine)"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() != "":
        devices = [d.strip() for d in visible.split(",") if d.strip()]
        if local_gpu_index >= len(devices):
            raise ValueError(
                f"local_gpu_index {local_gpu_index} is out of range for "
                f"CUDA_VISIBLE_DEVICES={visible!r} ({len(devices)} devices)"
            )
        chosen = devices[local_gpu_index]
    else:
        chosen = str(local_gpu_index)
    os.environ["CUDA_VISIBLE_DEVICES"] = chosen
    logger.info("restricted this process to GPU %s (CUDA_VISIBLE_DEVICES)", chosen)
    return chosen
