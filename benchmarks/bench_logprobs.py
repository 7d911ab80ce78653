"""The last stage's log-probs: plain log_softmax over the whole [N, V] against the chunked version
(rlft.pipeline.token_logprobs) and its fused chunks (each chunk's element-wise work compiled, as
`model.compile_layers` runs it), forward + backward, same shapes, same run.

    python benchmarks/bench_logprobs.py [--tokens 1024] [--hidden 1536] [--vocab 151936] [--dtype float32]
                                        [--repeats 3] [--modes plain,chunked,fused] [--json OUT.json]

Each variant runs in its own process (peak memory is a per-process figure): on a GPU the peak of
torch's allocator beyond the inputs, on CPU the growth of the process's max RSS.  Prints a table
and the ratios chunked / plain and fused / chunked (the compile happens in the warm-up step, not
timed); writes JSON with the command, shapes, machine and figures.
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time


def measure(mode: str, tokens: int, hidden: int, vocab: int, dtype: str, repeats: int) -> dict:
    import torch

    from rlft.pipeline.token_logprobs import default_chunk_tokens, next_token_logprobs, plain_next_token_logprobs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    h = (torch.randn(1, tokens + 1, hidden, device=device, dtype=dt) * 0.05).requires_grad_(True)
    w = (torch.randn(vocab, hidden, device=device, dtype=dt) * 0.05).requires_grad_(True)
    ids = torch.randint(0, vocab, (1, tokens + 1), device=device)

    def step():
        if mode == "plain":
            logp, = plain_next_token_logprobs(h, w, ids, compute_entropy=False)
        else:
            fused = mode == "fused"
            logp, = next_token_logprobs(h, w, ids, compute_entropy=False, fused=fused,
                                        chunk_tokens=default_chunk_tokens(vocab, fused, w.element_size()))
        logp.sum().backward()
        h.grad = w.grad = None

    # The memory beyond the inputs: measured from before the first step (warm-up included: the
    # same computation), as the allocator's peak on a GPU and the max RSS's growth on CPU.
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step()  # warm-up, not timed
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) if device == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"mode": mode, "device": device, "seconds": sorted(times)[len(times) // 2],
            "peak_extra_gib": peak / 2**30 if device == "cuda" else None,
            "max_rss_growth_gib": None if device == "cuda" else peak / 2**30}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="plain,chunked,fused", help="comma-separated: plain, chunked, fused")
    p.add_argument("--json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(measure(a.child, a.tokens, a.hidden, a.vocab, a.dtype, a.repeats)))
        return 0
    results = {}
    for mode in a.modes.split(","):
        cmd = [sys.executable, __file__, "--child", mode, "--tokens", str(a.tokens), "--hidden", str(a.hidden),
               "--vocab", str(a.vocab), "--dtype", a.dtype, "--repeats", str(a.repeats)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        results[mode] = json.loads(out)
    device = next(iter(results.values()))["device"]
    mem = "peak_extra_gib" if device == "cuda" else "max_rss_growth_gib"
    print(f"{a.tokens} tokens x vocab {a.vocab} x hidden {a.hidden}, {a.dtype}, {device}, "
          f"forward + backward, median of {a.repeats}")
    for mode, r in results.items():
        print(f"  {mode:8s} {r['seconds']:8.3f} s   memory {r[mem]:7.3f} GiB ({mem})")
    ratios = {}
    for new, base in (("chunked", "plain"), ("fused", "chunked")):
        if new in results and base in results:
            x, y = results[new], results[base]
            r = ratios[f"{new}/{base}"] = {"seconds": x["seconds"] / y["seconds"],
                                           "memory": (x[mem] / y[mem]) if y[mem] else None}
            memory_ratio = "-" if r["memory"] is None else f"{r['memory']:.2f}"
            print(f"  {new} / {base}: time {r['seconds']:.2f}, memory {memory_ratio}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": sys.argv, "shape": vars(a), "machine": platform.platform(),
                       "python": platform.python_version(), "results": results, "ratios": ratios}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
