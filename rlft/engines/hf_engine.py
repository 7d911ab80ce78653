"""Rollout engine on HF ``generate``: the fallback where vLLM is absent, and the fast path
for tiny CPU tests.

It reproduces vLLM's sampling semantics rather than HF's defaults:

* the repetition penalty sees prompt + response tokens but not the left padding (HF's own
  processor would also penalise the pad id of padded rows);
* penalty, then temperature, then top-p, in vLLM's order (HF would apply a custom processor
  after its own warpers);
* a stop string ends a response at the token that completes it, only after ``min_tokens``
  tokens, and ``token_ids`` keep that whole token while ``text`` is cut at the stop string;
* a response that stops on eos keeps the eos id as its last token;
* each sampled token's log-prob is the one vLLM returns by default (``raw_logprobs``): of the
  model's own logits, before ``min_tokens``, the penalty, temperature and top-p.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    StoppingCriteria,
    StoppingCriteriaList,
)

from rlft.common import torch_dtype
from rlft.models.families import checkpoint_tensors
from rlft.engines.base import Completion, RolloutEngine, SamplingSpec, weights_checksum_of

logger = logging.getLogger(__name__)

class VLLMStyleLogitsProcessor(LogitsProcessor):
    """Repetition penalty (ignoring left padding), temperature and top-p, in vLLM's order.

    Args:
        pad_lens: ``[B]`` number of left-pad positions of each row of ``input_ids``.
        repetition_penalty: > 0; 1 disables it.
        temperature: > 0 when sampling; ``None`` for greedy (argmax is scale-invariant).
        top_p: in (0, 1]; 1 disables it.
    """

    def __init__(self, pad_lens: torch.Tensor, repetition_penalty: float, temperature: float | None, top_p: float):
        self.pad_lens = pad_lens
        self.repetition_penalty = repetition_penalty
        self.temperature = temperature
        self.top_p = top_p

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """``input_ids`` ``[B, T]`` (left-padded prompt + response so far), ``scores`` ``[B, V]``."""
        if self.repetition_penalty != 1.0:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            valid = (positions[None, :] >= self.pad_lens[:, None]).to(scores.dtype)  # [B, T]
            # scatter_add, not scatter: a token can sit at both a pad and a real position.
            seen = torch.zeros_like(scores).scatter_add_(1, input_ids, valid) > 0  # [B, V]
            penalised = torch.where(scores > 0, scores / self.repetition_penalty, scores * self.repetition_penalty)
            scores = torch.where(seen, penalised, scores)
        if self.temperature is not None and self.temperature != 1.0:
            scores = scores / self.temperature
        if self.temperature is not None and self.top_p < 1.0:
            # vLLM's rule: sort ascending, drop tokens whose cumulative probability stays
            # within 1 - top_p, always keep the most likely token.
            sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
            cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
            drop_sorted = cumulative <= 1 - self.top_p
            drop_sorted[:, -1] = False
            drop = drop_sorted.scatter(1, order, drop_sorted)
            scores = scores.masked_fill(drop, float("-inf"))
        return scores


class _MinTokens(LogitsProcessor):
    """Eos cannot end a response before ``min_tokens`` tokens (vLLM's ``min_tokens``; HF's
    ``min_new_tokens`` would run before :class:`_SampledLogprobs` and hide the raw eos logit)."""

    def __init__(self, prompt_width: int, min_tokens: int, eos_token_ids: Sequence[int]):
        self.prompt_width = prompt_width
        self.min_tokens = min_tokens
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] - self.prompt_width < self.min_tokens:
            scores = scores.clone()
            scores[:, self.eos_token_ids] = float("-inf")
        return scores


class _SampledLogprobs(LogitsProcessor):
    """Records the log-prob of every sampled token under the model's raw logits.

    Must be the first processor, so that ``scores`` are the model's logits (``generate`` passes
    them in float32). The token drawn from step t's distribution is only known at step t + 1 (the
    last column of ``input_ids``), so only one step's ``log_softmax`` ``[B, V]`` is held at a time;
    :meth:`collect` reads the last step's from the finished sequences.
    """

    def __init__(self):
        self.pending: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.pending is not None:
            self.steps.append(self.pending.gather(1, input_ids[:, -1:]).squeeze(1))
        self.pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def collect(self, sequences: torch.LongTensor, generated: int) -> torch.Tensor:
        """``[B, generated]`` log-probs of the last ``generated`` columns of ``sequences``."""
        steps = list(self.steps)
        if self.pending is not None:
            steps.append(self.pending.gather(1, sequences[:, -1:]).squeeze(1))
        if len(steps) != generated:
            raise RuntimeError(f"recorded log-probs of {len(steps)} steps for {generated} generated tokens")
        if not steps:
            return torch.zeros((sequences.shape[0], 0))
        return torch.stack(steps, dim=1).cpu()


def find_stop(
    token_ids: Sequence[int],
    decode: Callable[[Sequence[int]], str],
    stops: Sequence[str],
    min_tokens: int,
    include_stop_str_in_output: bool,
) -> tuple[int, str] | None:
    """Where a response ends on a stop string, as vLLM's detokenizer decides it.

    The response ends at the smallest ``k > min_tokens`` such that ``decode(token_ids[:k])``
    holds a stop string ending after the text of the first ``min_tokens`` tokens.

    Returns:
        ``(k, text)`` — keep ``token_ids[:k]``; ``text`` is cut right after (or, without
        ``include_stop_str_in_output``, right before) the earliest-ending stop string — or
        ``None`` when no stop string completes.
    """
    if not stops or len(token_ids) <= min_tokens:
        return None
    base = len(decode(token_ids[:min_tokens])) if min_tokens > 0 else 0

    def earliest(text: str) -> tuple[int, int] | None:
        best = None
        for s in stops:
            start = text.find(s, max(0, base - len(s) + 1))
            if start != -1 and (best is None or start + len(s) < best[0]):
                best = (start + len(s), start)
        return best

    if earliest(decode(token_ids)) is None:
        return None
    # Binary search for the first prefix that holds a stop string (decoded prefixes grow
    # monotonically, so "holds a stop string" is monotone in k).
    lo, hi = min_tokens + 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if earliest(decode(token_ids[:mid])) is None:
            lo = mid + 1
        else:
            hi = mid
    text = decode(token_ids[:lo])
    end, start = earliest(text)
    return lo, text[:end] if include_stop_str_in_output else text[:start]


class _StopStringCriteria(StoppingCriteria):
    """Ends a row early once a stop string completes (after ``min_tokens`` tokens).

    Only a speed-up: it decodes a short tail per row, and :func:`find_stop` later decides
    the exact cut. ``fired_at[row]`` records the response length at which it fired.
    """

    def __init__(self, tokenizer, stops: Sequence[str], prompt_width: int, min_tokens: int):
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.prompt_width = prompt_width
        self.min_tokens = min_tokens
        # A stop string spans at most len(utf-8 bytes) tokens; one more gives the text before.
        self.window = max(len(s.encode("utf-8")) for s in self.stops) + 1
        self.fired_at: dict[int, int] = {}

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        batch, width = input_ids.shape
        generated = width - self.prompt_width
        done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        if generated <= self.min_tokens:
            return done
        rows = [r for r in range(batch) if r not in self.fired_at]
        if not rows:
            return done
        start = max(self.prompt_width, width - self.window)
        tails = input_ids[rows, start:].tolist()
        new = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
        old = self.tokenizer.batch_decode([t[:-1] for t in tails], skip_special_tokens=True)
        for row, text_new, text_old in zip(rows, new, old):
            if any(text_new.find(s, max(0, len(text_old) - len(s) + 1)) != -1 for s in self.stops):
                self.fired_at[row] = generated
                done[row] = True
        return done


class HFEngine(RolloutEngine):
    """Rollout engine on ``transformers``' ``generate``.

    Args:
        model: a local HF model directory / hub id, or an already built causal LM, which the
            engine then owns (it replaces ``model.generation_config`` and takes weight updates).
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"auto"``.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        seed: seeds the stream used when ``SamplingSpec.seed`` is ``None``.
        tokenizer: defaults to the one stored with the model.
        max_batch_sequences: upper bound on rows (prompts x n) per ``generate`` call.
    """

    def __init__(
        self,
        model: str | PreTrainedModel,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        seed: int = 0,
        tokenizer=None,
        max_batch_sequences: int = 64,
    ):
        dtype = torch_dtype(dtype)
        if isinstance(model, str):
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(model)
            model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype or "auto")
        elif tokenizer is None:
            raise ValueError("HFEngine needs a tokenizer when given a model object")
        if dtype is not None:
            model = model.to(dtype)
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.max_batch_sequences = max_batch_sequences
        self._seed = seed
        self._calls = 0

        # vLLM stops on the tokenizer's eos and on the generation config's eos ids.
        eos = set()
        for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                eos.add(source)
            elif source is not None:
                eos.update(source)
        if not eos:
            raise ValueError("the tokenizer and model define no eos token id")
        self.eos_token_ids = sorted(eos)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        # generate() fills unset options from model.generation_config (a checkpoint's
        # top_k=50, say); a neutral config keeps SamplingSpec the only source of settings.
        self.model.generation_config = GenerationConfig()

        # remove_duplicate=False keeps "lm_head.weight" addressable when it is tied.
        # The model's names, and the checkpoint's where they differ (a mixture of experts' weights one
        # per expert, as the policy's stages send them): views into the fused parameters.
        with torch.no_grad():
            self._params = {key: view for name, p in self.model.named_parameters(remove_duplicate=False)
                            for key, view in [(name, p), *checkpoint_tensors(self.model.config, name, p)]}

    # ------------------------------------------------------------------ generate
    def generate(self, prompt_token_ids: list[list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        spec.validate()
        vocab = self.model.get_input_embeddings().weight.shape[0]
        for i, prompt in enumerate(prompt_token_ids):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
        seed = spec.seed if spec.seed is not None else self._seed * 1_000_003 + self._calls
        self._calls += 1

        per_call = max(1, self.max_batch_sequences // spec.n)
        results: list[list[Completion]] = []
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            torch.manual_seed(seed)
            for start in range(0, len(prompt_token_ids), per_call):
                results.extend(self._generate_batch(prompt_token_ids[start : start + per_call], spec))
        return results

    def _generate_batch(self, prompts: list[list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        # HF refuses n > 1 without sampling; greedy copies are identical anyway (as on vLLM).
        n_sampled = 1 if spec.greedy else spec.n
        pad_lens = torch.tensor([width - len(p) for p in prompts]).repeat_interleave(n_sampled).to(self.device)

        config = GenerationConfig(
            do_sample=not spec.greedy,
            temperature=1.0,  # applied by VLLMStyleLogitsProcessor, after the penalty
            top_p=1.0,
            repetition_penalty=1.0,
            max_new_tokens=spec.max_tokens,  # min_tokens: _MinTokens below
            num_return_sequences=n_sampled,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
        )
        if not spec.greedy:
            config.top_k = 0  # HF's default top_k=50 would otherwise apply (vLLM: no top-k)
        recorder = _SampledLogprobs() if spec.logprobs else None
        processors = LogitsProcessorList([
            *([recorder] if recorder is not None else []),  # first: it reads the raw logits
            _MinTokens(width, spec.min_tokens, self.eos_token_ids),
            VLLMStyleLogitsProcessor(
                pad_lens, spec.repetition_penalty, None if spec.greedy else spec.temperature, spec.top_p
            ),
        ])
        criteria = StoppingCriteriaList()
        stopper = None
        if spec.stop:
            stopper = _StopStringCriteria(self.tokenizer, spec.stop, width, spec.min_tokens)
            criteria.append(stopper)
        output = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            generation_config=config,
            logits_processor=processors,
            stopping_criteria=criteria,
        )
        generated = output[:, width:].tolist()  # [P * n_sampled, T], prompt-major
        logprobs = recorder.collect(output, output.shape[1] - width).tolist() if recorder is not None else None
        completions = []
        for row, ids in enumerate(generated):
            c = self._finish(ids, spec, stopper.fired_at.get(row) if stopper is not None else None)
            if logprobs is not None:
                c.logprobs = logprobs[row][: len(c.token_ids)]
            completions.append(c)
        if n_sampled == spec.n:
            return [completions[i * spec.n : (i + 1) * spec.n] for i in range(len(prompts))]
        return [
            [replace(c, token_ids=list(c.token_ids), logprobs=None if c.logprobs is None else list(c.logprobs))
             for _ in range(spec.n)]
            for c in completions
        ]

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _finish(self, ids: list[int], spec: SamplingSpec, fired_at: int | None) -> Completion:
        """Cut one generated row (padded after it finished) the way vLLM ends a response."""
        eos_set = set(self.eos_token_ids)
        eos_at = next((i for i, t in enumerate(ids) if t in eos_set), None)
        limit = len(ids) if eos_at is None else eos_at + 1
        if fired_at is not None:
            limit = min(limit, fired_at)
        stop = find_stop(ids[:limit], self._decode, spec.stop, spec.min_tokens, spec.include_stop_str_in_output)
        if stop is not None:
            k, text = stop
            return Completion(token_ids=ids[:k], text=text, finish_reason="stop")
        if eos_at is not None and eos_at < limit:
            kept = ids[: eos_at + 1]
            return Completion(token_ids=kept, text=self._decode(kept), finish_reason="eos")
        if fired_at is not None:
            kept = ids[:fired_at]
            return Completion(token_ids=kept, text=self._decode(kept), finish_reason="stop")
        return Completion(token_ids=ids, text=self._decode(ids), finish_reason="length")

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            param = self._params.get(name)
            if param is None:
                raise ValueError(f"update_weights: unknown parameter name {name!r} for {type(self.model).__name__}")
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            param.copy_(tensor)

    def weights_checksum(self) -> dict[str, float]:
        # parameters() yields a tied embedding once, like vLLM's shared module.
        return weights_checksum_of(self.model.parameters())

    def close(self) -> None:
        self.model = None
        self._params = {}
