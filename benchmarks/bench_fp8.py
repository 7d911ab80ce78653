"""FP8 rollouts against bf16, on vLLM alone: the same W-big-shaped work (PROMPTS prompts x N samples x
TOKENS tokens, every response that long) through two engines of one model held side by side, one
in bf16 and one with vLLM's FP8 weights (``quantization="fp8"``: weights quantised per tensor at
load, activations dynamically), in alternating order (bf16 first, then fp8 first, ...), each round
on an empty prefix cache.  One model per child process (a fresh CUDA context each):

    python benchmarks/bench_fp8.py --models random-0.5b,random-1.5b --out OUT

Prints each round and a summary line per model, and writes OUT/bench_fp8.json: every round's
seconds and tokens, and per model the medians over the rounds after the first of each engine and
the sample phase's gain (bf16 seconds / fp8 seconds - 1).  Random weights (``rlft.bench`` shapes)
give responses of fixed length; the speed of a decode step does not depend on what the weights say.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="random-0.5b,random-1.5b", help="rlft.bench model shapes, comma-separated")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--tokens", type=int, default=512, help="tokens per response (min and max)")
    p.add_argument("--prompt-tokens", type=int, default=200, help="tokens per prompt (random ids)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per engine (the first is a warm-up)")
    p.add_argument("--share", type=float, default=0.4, help="each engine's gpu_memory_utilization")
    p.add_argument("--out", required=True)
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child's model
    return p.parse_args(argv)


def run_one(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rlft.bench.presets import resolve_bench_model

    model = resolve_bench_model(args.one)
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1000, 100_000) for _ in range(args.prompt_tokens)])
               for _ in range(args.prompts)]
    engines = {}
    for name, extra in (("bf16", {}), ("fp8", {"quantization": "fp8"})):
        start = time.perf_counter()
        engines[name] = LLM(model=model, dtype="bfloat16", seed=0, gpu_memory_utilization=args.share, **extra)
        print(f"[fp8 bench] {args.one} {name}: engine up in {time.perf_counter() - start:.1f} s", flush=True)
    rounds = []
    for r in range(args.rounds):
        order = ("bf16", "fp8") if r % 2 == 0 else ("fp8", "bf16")
        for name in order:
            llm = engines[name]
            params = [SamplingParams(n=args.n, temperature=1.0, min_tokens=args.tokens, max_tokens=args.tokens,
                                     seed=1000 * r + i) for i in range(len(prompts))]
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
            rounds.append({"round": r, "engine": name, "seconds": seconds, "tokens": tokens})
            print(f"[fp8 bench] {args.one} round {r} {name}: {tokens} tokens in {seconds:.3f} s "
                  f"({tokens / seconds:.0f} tokens/s)", flush=True)
    summary = {}
    for name in engines:
        timed = [x["seconds"] for x in rounds if x["engine"] == name and x["round"] > 0]
        summary[name] = {"median_s": statistics.median(timed), "min_s": min(timed), "max_s": max(timed),
                         "tokens_per_s": rounds[-1]["tokens"] / statistics.median(timed)}
    summary["fp8_gain"] = summary["bf16"]["median_s"] / summary["fp8"]["median_s"] - 1
    print(f"[fp8 bench] {args.one}: bf16 {summary['bf16']['median_s']:.3f} s, fp8 {summary['fp8']['median_s']:.3f} s "
          f"a round (medians of rounds 1..{args.rounds - 1}): fp8 {summary['fp8_gain']:+.1%}", flush=True)
    return {"model": args.one, "rounds": rounds, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.one:
        (out / f"{args.one}.json").write_text(json.dumps(run_one(args), indent=1) + "\n")
        return 0
    results, rc = {}, 0
    for model in args.models.split(","):
        cmd = [sys.executable, __file__, "--one", model, *(argv if argv is not None else sys.argv[1:])]
        code = subprocess.call(cmd, env=dict(os.environ, VLLM_WORKER_MULTIPROC_METHOD="spawn"))
        result = out / f"{model}.json"
        results[model] = json.loads(result.read_text()) if code == 0 and result.is_file() else {"exit_status": code}
        rc = rc or code
    setup = {k: v for k, v in vars(args).items() if k not in ("out", "one")}
    (out / "bench_fp8.json").write_text(json.dumps({"setup": setup, "models": results}, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
