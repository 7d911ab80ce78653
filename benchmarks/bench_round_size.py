"""What a round of sampling costs as it grows past vLLM's CUDA graphs, on vLLM alone: what `grpo.oversample`
(fewer, larger rounds of dynamic sampling) buys, and what rlft's graph capture for large rounds
(`rlft.engines.vllm_backend.cuda_graph_options`) changes.  Two engines of one model side by side:

    default   vLLM's own settings: decode graphs for batches of up to 512 sequences, larger ones eager
    graphs    what rlft builds for a round of the largest size here: graphs captured up to it

Each round generates `prompts x n` sequences of exactly `--tokens` tokens (a round lasts as long as its
longest response; here all are that long), the two engines in alternating order, each on an empty
prefix cache, the first round of each size a warm-up.

    python benchmarks/bench_round_size.py --model random-0.5b --sizes 32,64,80,96 --out OUT

Writes OUT/bench_round_size.json: every round, and per engine and size the median seconds, the ms a
decode step (seconds / tokens) and the ratio to a round of the first size.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random-0.5b", help="an rlft.bench model shape or a model directory")
    p.add_argument("--sizes", default="32,64,80,96", help="prompts a round, comma-separated")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (grpo.group_size)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per response (min and max)")
    p.add_argument("--prompt-tokens", type=int, default=150)
    p.add_argument("--repeats", type=int, default=3, help="rounds per engine and size (the first is a warm-up)")
    p.add_argument("--share", type=float, default=0.3, help="each engine's gpu_memory_utilization")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rlft.bench.presets import resolve_bench_model
    from rlft.engines.vllm_backend import cuda_graph_options

    sizes = [int(s) for s in args.sizes.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_bench_model(args.model)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(vocab // 100, vocab * 2 // 3)
                                              for _ in range(args.prompt_tokens)]) for _ in range(max(sizes))]
    extras = {"default": {}, "graphs": cuda_graph_options(max(sizes) * args.n)}
    engines, started = {}, {}
    for name, extra in extras.items():
        t0 = time.perf_counter()
        engines[name] = LLM(model=model, dtype=args.dtype, seed=0, gpu_memory_utilization=args.share, **extra)
        started[name] = time.perf_counter() - t0
        print(f"[round bench] {name} {extra}: engine up in {started[name]:.1f} s", flush=True)
    rounds = []
    for size in sizes:
        for r in range(args.repeats):
            for name in (("default", "graphs") if r % 2 == 0 else ("graphs", "default")):
                llm = engines[name]
                params = [SamplingParams(n=args.n, temperature=1.0, min_tokens=args.tokens, max_tokens=args.tokens,
                                         seed=1000 * r + i) for i in range(size)]
                llm.reset_prefix_cache()
                t0 = time.perf_counter()
                outputs = llm.generate(prompts[:size], params, use_tqdm=False)
                seconds = time.perf_counter() - t0
                tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
                rounds.append({"engine": name, "prompts": size, "sequences": size * args.n, "repeat": r,
                               "seconds": seconds, "tokens": tokens})
                print(f"[round bench] {name} {size} prompts ({size * args.n} sequences), round {r}: "
                      f"{tokens} tokens in {seconds:.3f} s", flush=True)
    summary = {}
    for name in engines:
        summary[name] = {"engine_start_s": started[name], "options": extras[name]}
        for size in sizes:
            timed = [x["seconds"] for x in rounds if x["engine"] == name and x["prompts"] == size and x["repeat"] > 0]
            med = statistics.median(timed)
            summary[name][str(size)] = {"median_s": med, "min_s": min(timed), "max_s": max(timed),
                                        "ms_per_decode_step": 1000 * med / args.tokens}
    for size in sizes[1:]:
        for name in engines:
            s = summary[name]
            s[str(size)]["vs_rounds_of_first_size"] = s[str(size)]["median_s"] / s[str(sizes[0])]["median_s"]
    print("| engine | " + " | ".join(f"{s} prompts ({s * args.n} seq.)" for s in sizes) + " |")
    print("| --- |" + " --- |" * len(sizes))
    for name in engines:
        cells = [f"{summary[name][str(s)]['median_s']:.2f} s ({summary[name][str(s)]['ms_per_decode_step']:.1f} ms/step)"
                 for s in sizes]
        print(f"| {name} | " + " | ".join(cells) + " |")
    setup = {k: v for k, v in vars(args).items() if k != "out"}
    (out / "bench_round_size.json").write_text(json.dumps({"setup": setup, "rounds": rounds, "summary": summary},
                                                          indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
