"""LoRA adapters loaded into the vLLM engine (``model.lora.sync: adapter``), on the real vLLM CPU build.

One engine (float32, CPU, vLLM's LoRA on for rank 8) starts once for the file (~30 s).  Every test
first puts the base model's weights back and loads the adapter it needs, so the tests do not depend
on their order.  The adapters are peft's, with every weight random (peft's B = 0 would hide a wrong
A, scaling or module), alpha / rank = 3 (not a power of two: folding it into B rounds, as vLLM does).
"""
from __future__ import annotations

import copy
import importlib.util
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlft.engines import SamplingSpec, make_engine
from rlft.engines.base import adapter_weights_checksum
from rlft.engines.hf_engine import HFEngine
from rlft.engines.vllm_backend import VLLM_LORA_RANKS

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 8, 24.0
SETTINGS = {"rank": RANK, "alpha": ALPHA, "dropout": 0.0, "target_modules": TARGETS}
PROMPTS = [[1, 5, 7, 9], [3, 4, 8], [10, 11, 12, 13, 14], [2, 2, 2], [40, 41]]
GREEDY = SamplingSpec(temperature=0.0, min_tokens=0, max_tokens=8, stop=[], repetition_penalty=1.0)
SAMPLED = SamplingSpec(temperature=1.0, min_tokens=8, max_tokens=8, stop=[], repetition_penalty=1.0, n=2, seed=11)
# Log-probs of the same sampled tokens: the adapter applied as x A^T (s B)^T beside W against one
# merged W' = W + s B A (float32, a tiny model): they agree to ~1e-6; allowed 1e-4.
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_models import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("vllm_lora") / "qwen2", family="qwen2")


@pytest.fixture(scope="module")
def base(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), \
        AutoTokenizer.from_pretrained(model_dir)


def peft_adapter(base_model, seed: int):
    """(peft model, its adapters under the names rlft's stages send: ...q_proj.lora_A.weight)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base_model), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.05 if ".lora_B." in name else 0.2))
    state = {n.replace(".default.", "."): p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}
    return model.eval(), state


@pytest.fixture(scope="module")
def adapters(base):
    return [peft_adapter(base[0], seed) for seed in (1, 2)]


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = make_engine("vllm", model_dir, dtype="float32", device="cpu", seed=0,
                      options=dict(max_model_len=128, kv_cache_memory_bytes=32 << 20, lora_adapter=SETTINGS))
    yield eng
    eng.close()


def projections(state: dict) -> list:
    """The weights the adapters change (with those vLLM fuses with them: all seven here), under HF names."""
    return [(n, t) for n, t in state.items() if n.rsplit(".", 2)[-2] in TARGETS]


@pytest.fixture
def at_base(engine, base):
    """The engine with the base model's weights (a test may have merged an adapter into them)."""
    engine.update_weights(projections(base[0].state_dict()))
    return engine


def load(engine, state: dict, parts: int = 2) -> None:
    """The adapters in `parts` parts (as pipeline stages send them), then loaded once."""
    items = list(state.items())
    for k in range(parts):
        engine.update_adapter(items[k::parts])
    engine.finish_adapter_update()


def hf_greedy(model, tokenizer) -> list[list[int]]:
    return [c[0].token_ids for c in HFEngine(model, dtype="float32", tokenizer=tokenizer).generate(PROMPTS, GREEDY)]


def tokens(groups) -> list[list[list[int]]]:
    return [[c.token_ids for c in group] for group in groups]


def test_vllm_lora_ranks_are_rlfts_copy():
    from rlft.engines.vllm_lora import max_lora_rank, vllm_lora_ranks

    assert vllm_lora_ranks() == VLLM_LORA_RANKS  # the config's check reads rlft's copy, without vLLM
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 16, 17, 300, 512)] == [1, 8, 8, 16, 16, 32, 320, 512]
    with pytest.raises(ValueError, match=r"model.lora.rank: 513 is more than vLLM's largest LoRA rank \(512\)"):
        max_lora_rank(513)


def test_an_adapter_sent_in_parts_samples_as_hf_merged_and_its_checksum_is_what_was_sent(at_base, base, adapters):
    engine, (model, tokenizer) = at_base, base
    peft_model, state = adapters[0]
    load(engine, state)
    got = tokens(engine.generate(PROMPTS, GREEDY))
    want = hf_greedy(copy.deepcopy(peft_model).merge_and_unload(), tokenizer)
    assert [g[0] for g in got] == want
    assert want != hf_greedy(model, tokenizer)  # the adapter changes the policy's tokens
    assert set(engine.llm.llm_engine.list_loras()) == {engine.lora_request.lora_int_id} and engine.takes_adapters
    # What vLLM's LoRA manager holds (scaling folded into B, q/k/v and gate/up packed) is what was sent.
    held, sent = engine.adapter_checksum(), adapter_weights_checksum(state.items(), scaling=ALPHA / RANK,
                                                                     dtype=torch.float32)
    assert held["sum"] == pytest.approx(sent["sum"], rel=1e-12, abs=1e-12)
    assert held["abs_sum"] == pytest.approx(sent["abs_sum"], rel=1e-12)
    assert not engine.adapters.file_only


def test_a_second_adapter_replaces_the_first(at_base, base, adapters):
    engine, tokenizer = at_base, base[1]
    load(engine, adapters[0][1])
    first = engine.lora_request
    load(engine, adapters[1][1], parts=3)
    second = engine.lora_request
    assert second.lora_int_id > first.lora_int_id and second.lora_name != first.lora_name
    assert set(engine.llm.llm_engine.list_loras()) == {second.lora_int_id}  # vLLM holds the new one alone
    assert not Path(first.lora_path).exists() and Path(second.lora_path).is_dir()
    got = [g[0] for g in tokens(engine.generate(PROMPTS, GREEDY))]
    want = hf_greedy(copy.deepcopy(adapters[1][0]).merge_and_unload(), tokenizer)
    assert got == want
    assert want != hf_greedy(copy.deepcopy(adapters[0][0]).merge_and_unload(), tokenizer)


def test_sampled_logprobs_match_the_merged_weights_update(at_base, adapters):
    engine = at_base
    peft_model, state = adapters[1]
    load(engine, state)
    with_adapter = engine.generate(PROMPTS, SAMPLED)
    # The same policy as merged weights in the same engine, with an adapter of B = 0 (the identity).
    engine.update_weights(projections(copy.deepcopy(peft_model).merge_and_unload().state_dict()))
    load(engine, {n: torch.zeros_like(t) if ".lora_B." in n else t for n, t in state.items()})
    merged = engine.generate(PROMPTS, SAMPLED)
    assert tokens(merged) == tokens(with_adapter)  # the same seeds draw the same tokens
    worst = max(abs(a - b) for ga, gb in zip(with_adapter, merged) for ca, cb in zip(ga, gb)
                for a, b in zip(ca.logprobs, cb.logprobs))
    assert worst <= LOGPROB_TOL, worst


def test_the_raw_engine_baseline_samples_with_the_adapter_too(at_base, adapters):
    """sampling.vllm.raw_engine_baseline (benchmarks): vLLM's own generate on the same requests also gets
    the adapter, so it times the same policy; rlft's rollouts are unchanged by it."""
    engine = at_base
    load(engine, adapters[0][1])
    alone = engine.generate(PROMPTS[:2], SAMPLED)
    requests, real = [], engine.llm.generate

    def counted(prompts, params, use_tqdm=False, **kwargs):
        requests.append(kwargs.get("lora_request"))
        return real(prompts, params, use_tqdm=use_tqdm, **kwargs)

    engine.raw_engine_baseline, engine.llm.generate = True, counted
    try:
        assert engine.generate(PROMPTS[:2], SAMPLED) == alone
        assert len(engine.raw_engine_seconds) == 1
    finally:
        del engine.llm.generate
        engine.raw_engine_baseline, engine.raw_engine_seconds = False, []
    assert requests == [engine.lora_request] * 2


class FakeBridge:
    """One rank: the gather is this rank's own numbers."""

    def gather_objects(self, obj, dst):
        return [obj]


class CorruptingEngine:
    """The engine, but one adapter weight changes on its way in (a transport that corrupts it)."""

    def __init__(self, engine, shift: float):
        self.engine, self.shift = engine, shift

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def update_adapter(self, named):
        named = [(n, t.clone()) for n, t in named]
        name, t = next((n, t) for n, t in named if ".lora_B." in n)
        t[0, 0] += self.shift
        self.engine.update_adapter(named)


def one_rank_sync(engine, state: dict):
    """`sync_weights` on one rank holding a one-stage policy (its adapters: `state`) and the sampler."""
    from rlft.config import build_config
    from rlft.config.topology import roles_for_rank
    from rlft.runtime.context import RankContext
    from rlft.runtime.sync import sync_weights

    cfg = build_config({}, ["device=cpu", "sampling.backend=vllm", "model.lora.enabled=true", "model.lora.sync=adapter",
                            f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", "topology.policy_ranks=[0]",
                            "topology.pipeline_stages=1", "topology.sampler_rank=0", "topology.reference_rank=0",
                            "topology.evaluator_rank=0"])
    ctx = RankContext(cfg, roles_for_rank(cfg.topology, 0), FakeBridge(), torch.device("cpu"))
    ctx.policy = SimpleNamespace(adapter_state=lambda: dict(state))
    ctx.rollout = SimpleNamespace(engine=engine)
    return sync_weights(ctx)


def test_the_sync_proves_the_adapter_and_stops_on_a_corrupted_one(at_base, adapters):
    from rlft.runtime.sync import WeightSyncError

    state = adapters[0][1]
    out = one_rank_sync(at_base, state)
    assert out["sync/engine_sum"] == pytest.approx(out["sync/policy_sum/stage0"], rel=1e-12)
    assert out["sync/engine_abs_sum"] == pytest.approx(out["sync/policy_abs_sum/stage0"], rel=1e-12)
    assert 0 < out["time/sync/load_finish"] <= out["time/sync/load"]
    abs_sum = out["sync/policy_abs_sum/stage0"]
    # One element of one B off by 0.1: scaled by 3, 0.3 of an absolute sum of ~5e3 (6e-5 > 1e-6).
    with pytest.raises(WeightSyncError, match="does not hold the policy's LoRA adapter") as err:
        one_rank_sync(CorruptingEngine(at_base, 0.1), state)
    assert f"against {abs_sum:.10g}" in str(err.value)


def test_the_checksum_reads_vllms_memory_and_falls_back_to_the_file(at_base, adapters, caplog):
    from safetensors.torch import load_file, save_file

    engine, state = at_base, adapters[0][1]
    load(engine, state)
    sent = adapter_weights_checksum(state.items(), scaling=ALPHA / RANK, dtype=torch.float32)
    # The file changed after vLLM loaded it: what vLLM holds is still what was sent.
    path = Path(engine.lora_request.lora_path) / "adapter_model.safetensors"
    tensors = load_file(str(path))
    name = next(n for n in tensors if ".lora_A." in n)
    tensors[name] = tensors[name] + 1.0
    save_file(tensors, str(path))
    assert engine.adapter_checksum()["sum"] == pytest.approx(sent["sum"], rel=1e-12)
    # A vLLM whose LoRA manager cannot be read (the worker answers None): the file's sums, said once.
    rpc = engine.adapters.rpc
    engine.adapters.rpc = lambda *args: None
    try:
        with caplog.at_level(logging.WARNING, logger="rlft.engines.vllm_lora"):
            first, second = engine.adapter_checksum(), engine.adapter_checksum()
    finally:
        engine.adapters.rpc, engine.adapters.file_only = rpc, False
    assert first == second
    assert first["sum"] == pytest.approx(sent["sum"] + tensors[name].numel(), rel=1e-9)
    assert sum("covers the adapter file" in r.getMessage() for r in caplog.records) == 1
