"""Rollout engine on vLLM, with in-place weight updates from the owning process.

The engine's owner (the process that builds ``LLM``) is rank 0 of a private two-rank group;
vLLM's worker, which runs in a child process (V1 multiprocessing), is rank 1. An update
streams HF-named tensors in buckets: for each bucket the owner starts the worker's
``rlft_load_bucket`` RPC on a helper thread and, meanwhile, pushes the bucket's bytes
(gloo/NCCL broadcast), or hands over a CUDA IPC handle in the RPC itself. See
:mod:`rlft.engines.vllm_sender` for the owner's side and :mod:`rlft.engines.vllm_worker` for the
worker's and the transports; what the launch knows of this engine is its record,
:mod:`rlft.engines.vllm_backend`.  Built with ``lora_adapter`` it loads the policy's LoRA adapters
instead (``update_adapter``, ``finish_adapter_update``; :mod:`rlft.engines.vllm_lora`), and every
``generate`` computes with the adapter loaded last.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from rlft.engines.base import Completion, EngineUnavailable, RolloutEngine, SamplingSpec
from rlft.engines.vllm_backend import check_vllm, vllm_is_cpu_build
from rlft.engines.vllm_requests import completion_of, decode_texts, params_of, run_continuous
from rlft.engines.vllm_sender import TRANSPORTS, WeightSender

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "rlft.engines.vllm_worker.WeightSyncExtension"


def _check_placement(device: torch.device, given: str, llm_kwargs: dict) -> None:
    """ValueError or EngineUnavailable where vLLM cannot run as asked: on a GPU other than its first
    visible one, with more than one worker, or on a device its build does not target."""
    if device.index not in (None, 0):
        raise ValueError(
            f"vLLM runs on its first visible GPU; instead of device={given!r}, call "
            "rlft.engines.restrict_to_device(index) before CUDA starts and pass 'cuda'"
        )
    for option in ("tensor_parallel_size", "pipeline_parallel_size"):
        if llm_kwargs.get(option, 1) != 1:
            # The weight-sync group has exactly two ranks: this process and one worker.
            raise ValueError(f"VLLMEngine supports one vLLM worker; got {option}={llm_kwargs[option]}")
    on_cpu = device.type == "cpu"
    if on_cpu != vllm_is_cpu_build():
        build = "CPU" if not on_cpu else "GPU"
        raise EngineUnavailable(f"the installed vLLM is a {build} build, but device={given!r}")


def _llm_kwargs(model_path: str, *, dtype: str, seed: int, tokenizer, enforce_eager: bool, max_model_len: int | None,
                enable_sleep_mode: bool, on_cpu: bool, gpu_memory_utilization: float,
                kv_cache_memory_bytes: int | None, lora_rank: int | None = None) -> dict:
    """``vllm.LLM``'s arguments for the engine (see :class:`VLLMEngine`); ``lora_rank``: it loads one
    LoRA adapter of that rank at a time."""
    kwargs = dict(
        model=model_path,
        dtype=dtype,
        seed=seed,
        enforce_eager=enforce_eager,
        max_model_len=max_model_len,
        worker_extension_cls=WORKER_EXTENSION,
        enable_sleep_mode=enable_sleep_mode,
        # Completion.logprobs: the raw model's log-probs, the trainer's definition (vLLM's
        # default, pinned here since the trainer's comparison depends on it).
        logprobs_mode="raw_logprobs",
    )
    if tokenizer is not None:
        kwargs["tokenizer"] = tokenizer if isinstance(tokenizer, str) else tokenizer.name_or_path
    if on_cpu:
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes or (256 << 20)
        # The worker inside the engine process, as vLLM runs it on a GPU.  vLLM's CPU platform would turn
        # "uni" into a worker process of its own (its executor sets that process's OpenMP threads); named by
        # its class it stays: one process fewer, and a tiny model's engine starts in 15.4 s instead of
        # 21.4 s, with 19.9 CPU-s instead of 29.1 (benchmarks/bench_cpu_engine.py, 2 cores).
        kwargs["distributed_executor_backend"] = "vllm.v1.executor.uniproc_executor.UniProcExecutor"
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    if lora_rank is not None:
        from rlft.engines.vllm_lora import max_lora_rank

        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=max_lora_rank(lora_rank))
    return kwargs


class VLLMEngine(RolloutEngine):
    """Rollout engine on ``vllm.LLM``.

    Args:
        model_path: local HF model directory (or hub id).
        dtype: ``"auto"``, ``"bfloat16"``, ``"float32"``...
        device: ``"cuda"`` or ``"cpu"``; vLLM uses the first visible GPU (see
            :func:`rlft.engines.base.restrict_to_device`).
        seed: vLLM's global seed (used when ``SamplingSpec.seed`` is ``None``).
        tokenizer: path (or a HF tokenizer, whose ``name_or_path`` is used) for detokenising
            responses; defaults to the model's own.
        gpu_memory_utilization, enforce_eager, max_model_len, enable_sleep_mode: as in vLLM.
        kv_cache_memory_bytes: KV cache size on CPU (vLLM cannot size it from free memory there).
        weight_transport: ``"auto"`` (gloo for CPU tensors, CUDA IPC for tensors on the
            engine's GPU, NCCL for tensors on another GPU) or one of those explicitly.
        bucket_bytes: tensors are packed and sent in buffers of about this size (one RPC each: on an
            H200, a 1.5B model's 2.9 GiB loaded in 54 ms in buckets of 256 MiB, 42 ms in 1 GiB).
        sync_timeout_s: timeout of the weight-sync group and its RPCs.
        use_tqdm: vLLM's progress bar during ``generate``.
        raw_engine_baseline: every ``generate`` also runs the same prompts through vLLM's own
            ``LLM.generate`` with vLLM's default outputs (text, no log-probs), the two in alternating
            order and each on an empty prefix cache; its seconds are appended to ``raw_engine_seconds``
            (benchmarks: rlft against the raw engine, interleaved on one engine and GPU).
        lora_adapter: ``model.lora``'s ``rank``, ``alpha``, ``dropout`` and ``target_modules``: the engine
            loads the policy's adapters (``update_adapter``; ``model.lora.sync: adapter``), with vLLM's
            LoRA enabled for one adapter of that rank; None: it takes weights only (``update_weights``).
        llm_kwargs: passed to ``vllm.LLM`` unchanged.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "auto",
        device: str = "cuda",
        seed: int = 0,
        tokenizer=None,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        max_model_len: int | None = None,
        enable_sleep_mode: bool = False,
        kv_cache_memory_bytes: int | None = None,
        weight_transport: str = "auto",
        bucket_bytes: int = 1 << 30,
        sync_timeout_s: float = 600.0,
        use_tqdm: bool = False,
        raw_engine_baseline: bool = False,
        lora_adapter: dict | None = None,
        **llm_kwargs,
    ):
        check_vllm()
        if weight_transport not in TRANSPORTS:
            raise ValueError(f"weight_transport must be one of {TRANSPORTS}, got {weight_transport!r}")
        from transformers import AutoConfig
        from vllm import LLM

        self.device = torch.device(device)
        _check_placement(self.device, device, llm_kwargs)
        on_cpu = self.device.type == "cpu"
        if on_cpu and enable_sleep_mode:
            logger.info("vLLM sleep mode is GPU-only; sleep()/wake() are no-ops on CPU")
            enable_sleep_mode = False
        self.enable_sleep_mode = enable_sleep_mode
        self.sync_timeout_s = sync_timeout_s
        self.use_tqdm = use_tqdm
        self.raw_engine_baseline, self.raw_engine_seconds, self._raw_calls = raw_engine_baseline, [], 0

        kwargs = _llm_kwargs(model_path, dtype=dtype, seed=seed, tokenizer=tokenizer, enforce_eager=enforce_eager,
                             max_model_len=max_model_len, enable_sleep_mode=enable_sleep_mode, on_cpu=on_cpu,
                             gpu_memory_utilization=gpu_memory_utilization,
                             kv_cache_memory_bytes=kv_cache_memory_bytes,
                             lora_rank=None if lora_adapter is None else lora_adapter["rank"])
        kwargs.update(llm_kwargs)
        self.llm = LLM(**kwargs)
        self.adapters = None
        if lora_adapter is not None:
            from rlft.engines.vllm_lora import AdapterSync

            self.adapters = AdapterSync(self.llm, lora_adapter, self._rpc)

        self._asleep = False
        self.weight_sender = WeightSender(
            self._rpc,
            _hf_parameter_shapes(AutoConfig.from_pretrained(model_path)),
            transport=weight_transport,
            bucket_bytes=bucket_bytes,
            timeout_s=sync_timeout_s,
        )

    # ------------------------------------------------------------------ generate
    def generate(self, prompt_token_ids: list[list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        self._check_request(prompt_token_ids, spec, "generate")
        detokenize = bool(spec.stop)
        # vLLM gives the j-th of n samples seed + j: distinct seeds for every sample.
        params = [params_of(spec, None if spec.seed is None else spec.seed + i * spec.n)
                  for i in range(len(prompt_token_ids))]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_token_ids]
        raw_first = self.raw_engine_baseline and self._raw_calls % 2 == 0  # A/B, then B/A, ...
        if raw_first:
            self._raw_generate(prompts, params)
        outputs = self.llm.generate(prompts, params, use_tqdm=self.use_tqdm, **self._adapter_kwargs())
        if self.raw_engine_baseline and not raw_first:
            self._raw_generate(prompts, params)
        groups = [
            [completion_of(o) for o in sorted(request.outputs, key=lambda o: o.index)]
            for request in outputs
        ]
        if not detokenize:
            decode_texts(self.llm.get_tokenizer(), [c for group in groups for c in group])
        return groups

    # Multi-turn episodes (rlft.envs.episodes) continue each episode as soon as its turn is answered.
    continuous_turns = True

    def generate_continuous(self, prompt_token_ids: list[list[int]], spec: SamplingSpec,
                            follow: Callable[[int, Completion], tuple[list[int], SamplingSpec] | None]) -> None:
        """``spec.n`` completions of each prompt, then whatever ``follow(key, completion)`` asks next, each
        request joining the running batch the moment it is made (:func:`rlft.engines.vllm_requests.run_continuous`)."""
        self._check_request(prompt_token_ids, spec, "generate_continuous")
        run_continuous(self.llm, prompt_token_ids, spec, follow, self._adapter_kwargs())

    def _check_request(self, prompt_token_ids: list[list[int]], spec: SamplingSpec, method: str) -> None:
        spec.validate()
        if self._asleep:
            raise RuntimeError(f"the vLLM engine is asleep; call wake() before {method}()")
        for i, prompt in enumerate(prompt_token_ids):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")

    def _raw_generate(self, prompts: list, params: list) -> None:
        """The same requests through ``LLM.generate`` with vLLM's default outputs, on an empty prefix
        cache (as a step's rollouts start after a sync), timed into ``raw_engine_seconds``."""
        import time

        from vllm import SamplingParams

        plain = [SamplingParams(n=p.n, temperature=p.temperature, top_p=p.top_p, min_tokens=p.min_tokens,
                                max_tokens=p.max_tokens, stop=p.stop or None, repetition_penalty=p.repetition_penalty,
                                seed=p.seed) for p in params]
        self.llm.reset_prefix_cache()
        start = time.perf_counter()
        self.llm.generate(prompts, plain, use_tqdm=False, **self._adapter_kwargs())
        self.raw_engine_seconds.append(time.perf_counter() - start)
        self._raw_calls += 1
        self.llm.reset_prefix_cache()

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self._asleep:
            raise RuntimeError("the vLLM engine is asleep; call wake() before update_weights()")
        try:
            self.weight_sender.update(named_tensors)
        finally:
            # Cached prefixes were computed with the old weights.
            self.llm.reset_prefix_cache()

    @property
    def last_sync_seconds(self) -> float | None:
        """Wall time of the last ``update_weights`` (excluding the prefix-cache reset)."""
        return self.weight_sender.last_seconds

    @property
    def last_sync_finish_seconds(self) -> float | None:
        """Of ``last_sync_seconds``, the worker's processing after the last bucket (``rlft_finish_update``);
        with adapters, the last ``finish_adapter_update`` (the directory written and vLLM's ``add_lora``)."""
        if self.adapters is not None:
            return self.adapters.last_seconds
        return self.weight_sender.last_finish_seconds

    # ------------------------------------------------------------------ LoRA adapters
    @property
    def takes_adapters(self) -> bool:
        return self.adapters is not None

    @property
    def lora_request(self):
        """The ``LoRARequest`` of the adapter every ``generate`` computes with (None: none loaded)."""
        return None if self.adapters is None else self.adapters.request

    def _adapter_kwargs(self) -> dict:
        """``LLM.generate``'s ``lora_request`` once an adapter is loaded (none without: as without LoRA)."""
        request = self.lora_request
        return {} if request is None else {"lora_request": request}

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._adapter_sync("update_adapter").add_part(named_tensors)

    def finish_adapter_update(self) -> None:
        try:
            self._adapter_sync("finish_adapter_update").finish()
        finally:
            self.llm.reset_prefix_cache()  # a new adapter id hashes apart anyway; the old one's blocks go

    def adapter_checksum(self) -> dict[str, float]:
        return self._adapter_sync("adapter_checksum").checksum()

    def _adapter_sync(self, method: str):
        if self.adapters is None:
            raise RuntimeError(f"{method}(): this vLLM engine was built without lora_adapter")
        if self._asleep:
            raise RuntimeError(f"the vLLM engine is asleep; call wake() before {method}()")
        return self.adapters

    def _rpc(self, method: str, *args):
        return self.llm.collective_rpc(method, timeout=self.sync_timeout_s, args=args)[0]

    def weights_checksum(self) -> dict[str, float]:
        return self._rpc("rlft_weights_checksum")

    # ------------------------------------------------------------------ lifecycle
    @property
    def sleeps(self) -> bool:
        return self.enable_sleep_mode

    def sleep(self, level: int = 1) -> None:
        """Level 1 keeps the weights in host memory; level 2 drops them (update before use)."""
        if not self.enable_sleep_mode:
            logger.info("vLLM engine was built without sleep mode; sleep() is a no-op")
            return
        before = _free_gpu_bytes()
        try:
            self.llm.sleep(level=level)
        except Exception as err:  # vLLM's own check of the GPU's free memory, as one line saying why
            explained = explain_sleep_failure(err)
            if explained is None:
                raise
            raise RuntimeError(explained) from err
        after = _free_gpu_bytes()
        # What waking takes back (the weights and the KV cache the engine just gave up).
        self._wake_bytes = None if before is None or after is None else max(0, after - before)
        self._asleep = True

    def wake(self) -> None:
        """Take the GPU memory back.  Where the GPU lacks room for what the engine gave up when it
        fell asleep (``WAKE_MARGIN`` more), the trainer on the same GPU first gives back the blocks
        its caching allocator holds but does not use (after a long batch, tens of GB): waking would
        otherwise find too little free memory and fail.  Where there is room, the trainer keeps
        them, and its next train phase need not allocate them again (on an H200 at W-big, the train
        phase beside an engine kept awake took 7.8 s against 8.1 s beside one woken after an emptied
        cache).  A full garbage collection (a tenth of a second in a process this size) runs only
        when emptying the cache is still not enough: tensors held in reference cycles are the only
        ones it can free."""
        if not self._asleep:
            return
        if torch.cuda.is_available():
            needed = getattr(self, "_wake_bytes", None)
            if needed is None or (_free_gpu_bytes() or 0) < needed + WAKE_MARGIN:
                torch.cuda.empty_cache()
                free = _free_gpu_bytes()
                if needed is None or free is None or free < needed:
                    import gc

                    gc.collect()
                    torch.cuda.empty_cache()
        self.llm.wake_up()
        self._asleep = False

    def close(self) -> None:
        if getattr(self, "llm", None) is None:
            return
        try:
            self.weight_sender.close()
            if self.adapters is not None:
                self.adapters.close()
        finally:
            engine_core = getattr(self.llm.llm_engine, "engine_core", None)
            if engine_core is not None and hasattr(engine_core, "shutdown"):
                engine_core.shutdown()
            self.llm = None


def explain_sleep_failure(err: BaseException) -> str | None:
    """What vLLM's failed ``sleep`` means, where it is its check that the GPU's free memory grew (it
    reads the whole GPU, so another process that allocates meanwhile fails it); None otherwise."""
    if "Memory usage increased after sleeping" not in str(err):
        return None
    return ("vLLM could not put the engine to sleep: the GPU had less free memory afterwards than before, "
            "so another process allocated on it meanwhile, and vLLM's sleep mode needs the GPU to itself; "
            "where runs share a GPU set sampling.vllm.sleep_mode: false (and topology.gpu_memory_fraction)")


# Free memory kept beyond what a sleeping engine takes back when it wakes, before the trainer's
# cached blocks are left alone: vLLM maps its memory in pieces, and the CUDA context grows.
WAKE_MARGIN = 2 << 30


def _free_gpu_bytes() -> int | None:
    """Free memory of the current GPU as the driver sees it (None without a GPU)."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.mem_get_info()[0]


def _hf_parameter_shapes(config) -> dict[str, tuple[int, ...]]:
    """The checkpoint's parameter names -> shapes, from a model built on the meta device (no memory):
    the HF model's names, a mixture of experts' fused parameters one per expert and part, as
    checkpoints and vLLM's ``load_weights`` name them (:func:`rlft.models.families.checkpoint_tensors`)."""
    from transformers import AutoModelForCausalLM

    from rlft.models.families import checkpoint_tensors

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {key: tuple(t.shape) for name, p in model.named_parameters(remove_duplicate=False)
            for key, t in checkpoint_tensors(config, name, p)}


__all__ = [
    "VLLMEngine",
    "WeightSender",
]
