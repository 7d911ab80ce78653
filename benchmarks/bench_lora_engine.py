"""LoRA served by vLLM against the merged weights, on vLLM alone: what adapter-only sync
(``model.lora.sync: adapter``) would cost in the sample phase and gain in the sync.  Two engines of
one model side by side: ``plain`` (the merged-weight sync's engine: no LoRA) and ``lora``
(``enable_lora``, every request with the policy's adapter), the same work through both in
alternating order, each round on an empty prefix cache.  Before each of its rounds the ``lora``
engine takes a new adapter as the sync would: written as a peft directory, loaded with
``add_lora`` under a new id, the previous one removed (timed as ``adapter_sync_s``).

    python benchmarks/bench_lora_engine.py --model random-0.5b --out OUT

The adapter: rank 16, alpha 32, on the seven projections of every decoder layer (rlft's default
``model.lora``), random A and B (B non-zero, so the adapter changes the outputs).  Writes
OUT/bench_lora_engine.json: every round, and the medians over the rounds after each engine's first.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random-0.5b", help="an rlft.bench model shape or a model directory")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--tokens", type=int, default=512, help="tokens per response (min and max)")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=6, help="timed rounds per engine (the first is a warm-up)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--share", type=float, default=0.35, help="each engine's gpu_memory_utilization")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def write_adapter(directory: Path, model_dir: str, rank: int, seed: int) -> int:
    """A peft adapter directory for every decoder layer's projections; returns its bytes."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    shapes = {"q_proj": (c.hidden_size, c.num_attention_heads * head),
              "k_proj": (c.hidden_size, c.num_key_value_heads * head),
              "v_proj": (c.hidden_size, c.num_key_value_heads * head),
              "o_proj": (c.num_attention_heads * head, c.hidden_size),
              "gate_proj": (c.hidden_size, c.intermediate_size), "up_proj": (c.hidden_size, c.intermediate_size),
              "down_proj": (c.intermediate_size, c.hidden_size)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(c.num_hidden_layers):
        for name, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5)
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), bias="none",
               task_type="CAUSAL_LM").save_pretrained(str(directory))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from rlft.bench.presets import resolve_bench_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_bench_model(args.model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(vocab // 100, vocab * 2 // 3) for _ in range(args.prompt_tokens)])
               for _ in range(args.prompts)]
    engines, started = {}, {}
    for name, extra in (("plain", {}), ("lora", {"enable_lora": True, "max_loras": 1, "max_lora_rank": args.rank})):
        start = time.perf_counter()
        engines[name] = LLM(model=model, dtype=args.dtype, seed=0, gpu_memory_utilization=args.share, **extra)
        started[name] = time.perf_counter() - start
        print(f"[lora bench] {name}: engine up in {started[name]:.1f} s", flush=True)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    rounds, current = [], None
    for r in range(args.rounds):
        for name in (("plain", "lora") if r % 2 == 0 else ("lora", "plain")):
            llm, request, record = engines[name], None, {"round": r, "engine": name}
            if name == "lora":  # the sync: a new adapter written, loaded, the old one removed
                t0 = time.perf_counter()
                directory = Path(tempfile.mkdtemp(prefix="rlft-adapter-", dir=shm))
                record["adapter_bytes"] = write_adapter(directory, model, args.rank, seed=r)
                t1 = time.perf_counter()
                request = LoRARequest(f"policy-{r + 1}", r + 1, str(directory))
                llm.llm_engine.add_lora(request)
                if current is not None:
                    llm.llm_engine.remove_lora(current)
                current = r + 1
                record.update(adapter_write_s=t1 - t0, adapter_load_s=time.perf_counter() - t1)
            params = [SamplingParams(n=args.n, temperature=1.0, min_tokens=args.tokens, max_tokens=args.tokens,
                                     seed=1000 * r + i) for i in range(len(prompts))]
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=request)
            record["seconds"] = time.perf_counter() - start
            record["tokens"] = sum(len(c.token_ids) for o in outputs for c in o.outputs)
            rounds.append(record)
            print(f"[lora bench] round {r} {name}: {record['tokens']} tokens in {record['seconds']:.3f} s"
                  + (f"; adapter written in {record['adapter_write_s']:.3f} s, loaded in {record['adapter_load_s']:.3f} s"
                     if name == "lora" else ""), flush=True)
    summary = {}
    for name in engines:
        timed = [x for x in rounds if x["engine"] == name and x["round"] > 0]
        summary[name] = {"median_s": statistics.median(x["seconds"] for x in timed),
                         "min_s": min(x["seconds"] for x in timed), "max_s": max(x["seconds"] for x in timed),
                         "engine_start_s": started[name]}
    timed_lora = [x for x in rounds if x["engine"] == "lora" and x["round"] > 0]
    summary["lora"]["adapter_write_median_s"] = statistics.median(x["adapter_write_s"] for x in timed_lora)
    summary["lora"]["adapter_load_median_s"] = statistics.median(x["adapter_load_s"] for x in timed_lora)
    summary["lora_sample_cost"] = summary["lora"]["median_s"] / summary["plain"]["median_s"] - 1
    print(f"[lora bench] {args.model}: plain {summary['plain']['median_s']:.3f} s, lora {summary['lora']['median_s']:.3f} s "
          f"a round (medians of rounds 1..{args.rounds - 1}): LoRA served {summary['lora_sample_cost']:+.1%}; adapter "
          f"write {summary['lora']['adapter_write_median_s']:.3f} s + load {summary['lora']['adapter_load_median_s']:.3f} s",
          flush=True)
    setup = {k: v for k, v in vars(args).items() if k != "out"}
    (out / "bench_lora_engine.json").write_text(json.dumps({"setup": setup, "rounds": rounds, "summary": summary},
                                                           indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
