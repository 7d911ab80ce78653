"""The raw engine's baseline: vLLM's own ``LLM.generate`` on the same prompts, lengths and sampling as an
rlft run's sampling phase, with nothing of rlft around it.

The benchmark writes a spec (JSON) and starts this module in its own process, after the rlft run has
released the GPU:

    python -m rlft.bench.raw_engine SPEC.json

Per step it generates ``group_size`` completions of forced length for that step's prompts (the
prompts an rlft run draws, in its order, tokenised by the model's tokenizer), with vLLM's default
outputs (text, no log-probs), and writes OUT/raw_engine.json: each step's seconds and generated
tokens, and the median tokens/s over the steps after the first (the rule of rlft's own figures).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path


def raw_engine_unavailable_reason() -> str | None:
    """Why the baseline cannot run here (None: it can)."""
    from rlft.engines.vllm_backend import VLLM

    if not VLLM.installed():
        return "vllm is not installed; the raw-engine baseline is skipped"
    return None


def step_prompts(prompts: list[str], steps: int) -> list[list[str]]:
    """The flat prompt order cut into ``steps`` equal steps."""
    per_step, rest = divmod(len(prompts), steps)
    if rest or not per_step:
        raise ValueError(f"{len(prompts)} prompts do not split into {steps} steps")
    return [prompts[i * per_step:(i + 1) * per_step] for i in range(steps)]


def summarise(step_records: list[dict]) -> dict:
    """Median tokens/s and seconds over the steps after the first (all of them when there is one)."""
    measured = step_records[1:] or step_records
    return {"tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in measured),
            "sample_s": statistics.median(r["seconds"] for r in measured),
            "measured_steps": [r["step"] for r in measured]}


def llm_kwargs(spec: dict) -> dict:
    """``vllm.LLM`` arguments: the rlft sampler's engine settings."""
    kwargs = {"model": spec["model"], "dtype": spec["dtype"], "seed": spec["seed"],
              "enforce_eager": spec["enforce_eager"], "max_model_len": spec["max_model_len"]}
    if spec["gpu"]:
        kwargs["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
    else:
        kwargs["kv_cache_memory_bytes"] = spec.get("kv_cache_memory_bytes") or (256 << 20)
    return kwargs


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    s, w = spec["sampling"], spec["workload"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    llm = LLM(**llm_kwargs(spec))
    n = w["group_size"]

    def params(seed: int) -> SamplingParams:
        return SamplingParams(n=n, temperature=s["temperature"], top_p=s["top_p"],
                              repetition_penalty=s["repetition_penalty"], min_tokens=s["min_tokens"],
                              max_tokens=s["max_tokens"], stop=list(s["stop"]) or None, seed=seed)

    records = []
    for step, texts in enumerate(step_prompts([p["prompt"] for p in spec["prompts"]], spec["steps"]), start=1):
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in tokenizer(texts)["input_ids"]]
        # Seeded per prompt as rlft's sampler seeds its requests (rlft.roles.rollout.RolloutWorker.sample_round).
        base = spec["seed"] * 1_000_003 + step
        per_prompt = [params(base + i * n) for i in range(len(prompts))]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, per_prompt, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        records.append({"step": step, "seconds": seconds, "tokens": tokens, "responses": sum(len(o.outputs) for o in outputs)})
        print(f"raw engine step {step}: {tokens} tokens in {seconds:.3f} s ({tokens / seconds:.1f} tokens/s)", flush=True)
    params = params(0)
    out = {"steps": records, "summary": summarise(records),
           "sampling_params": {"n": params.n, "temperature": params.temperature, "top_p": params.top_p,
                               "repetition_penalty": params.repetition_penalty, "min_tokens": params.min_tokens,
                               "max_tokens": params.max_tokens, "stop": params.stop, "logprobs": params.logprobs,
                               "detokenize": params.detokenize, "seed": "per prompt, as rlft's"},
           "llm": {k: v for k, v in llm_kwargs(spec).items() if k != "model"}}
    Path(spec["out_dir"], "raw_engine.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
