"""The benchmark's numbers from a run's per-step records (OUT/steps.jsonl): pure arithmetic.

Every figure is the median over the measured steps: all steps after the first (the first one
compiles kernels, captures CUDA graphs and fills caches).  A run of a single step is measured on
that step and says so (``warmup_excluded: false``).  Per step:

    step seconds         time/step - time/eval (the trainer always evaluates after its last step;
                         the benchmark turns the periodic evaluation off) - time/sample_raw_engine
    sample seconds       time/sample - time/sample_raw_engine   (with the raw-engine baseline on, the
                         sample phase also ran the engine's own generate, timed apart: rlft's figures
                         leave it out, and seconds["sample_raw_engine"] is its median)
    rollout tokens/s     tokens/response / sample seconds       (generated tokens, padding excluded)
    train tokens/s       tokens/total / time/train              (prompt + response tokens, padding excluded)
    train MFU            F * tokens/total / (time/train * peak FLOP/s), with
                           F = passes * 6 * N                    ("train_mfu": weights only)
                           F = passes * (6 * N + 12 * L * d * s) ("train_mfu_with_attention")
                         N = parameters (tied embeddings once), L = layers, d = hidden size,
                         s = mean sequence length of the step (tokens/total / sequences); passes = 1
                         forward + backward per epoch over the rollout (plus a forward, 1/3 pass,
                         when old log-probs are recomputed).  Activation recomputation is not counted
                         (model FLOPs, not hardware FLOPs).
    sync GB/s            weight bytes / time/sync, weight bytes = N * bytes per parameter of the
                         policy's dtype (one copy of the weights, 1 GB = 1e9 bytes)
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Iterable

# Dense bf16 peak FLOP/s by GPU name (first match, case-insensitive, in this order).  H200: 790
# TFLOP/s is the figure this project's H200 measurements are quoted against (NVIDIA's datasheet
# lists 989 TFLOP/s dense bf16 for the H100/H200 SXM parts); --peak-tflops sets any other value.
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 790e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
)

FORMULAS = {
    "step_s": "median over steps after the first of (time/step - time/eval - time/sample_raw_engine)",
    "sample_s": "median of time/sample - time/sample_raw_engine (the raw-engine baseline's generation, when on)",
    "rollout_tokens_per_s": "median of tokens/response / (time/sample - time/sample_raw_engine)",
    "train_tokens_per_s": "median of tokens/total / time/train (prompt + response tokens, no padding)",
    "train_mfu": "median of passes * 6 * N * tokens/total / (time/train * peak_flops); attention FLOPs ignored",
    "train_mfu_with_attention": "median of passes * (6 * N + 12 * L * d * s) * tokens/total / (time/train * "
                                "peak_flops), s = tokens/total / sequences per step",
    "sync_gb_per_s": "N * bytes per parameter (policy dtype) / 1e9 / time/sync (one copy of the weights; "
                     "time/sync includes waking sleeping engines)",
    "peak_flops": "dense bf16 by GPU name: H200 790e12 (this project's figure; datasheet 989e12), "
                  "H100 989e12, A100 312e12, or --peak-tflops",
    "memory_peak_gb": "per rank, max over steps of the rank's peak (GiB: torch's allocator peak on a GPU, "
                      "the process's max RSS on CPU); a role's figure is its rank's",
}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def peak_flops_for(gpu_name: str | None) -> tuple[float | None, str | None]:
    """(peak FLOP/s, where it came from) for a GPU name; (None, None) when unknown or on CPU."""
    if not gpu_name:
        return None, None
    for key, flops in PEAK_FLOPS:
        if key.lower() in gpu_name.lower():
            return flops, f"table:{key}"
    return None, None


def read_steps(path: str | Path) -> list[dict]:
    """The records of a steps.jsonl, in file order (the last record of a step wins)."""
    by_step: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step[int(rec["step"])] = rec
    return [by_step[k] for k in sorted(by_step)]


def _median(values: Iterable[float]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return statistics.median(vals) if vals else None


SYNC_PARTS = ("wake", "load", "load_finish", "checksum", "checksum_engine", "checksum_policy")


def measured_steps(steps: list[dict]) -> tuple[list[dict], bool]:
    """The steps the medians are taken over, and whether the warm-up step was left out.  A step
    run under the profiler (`schedule.profile_steps`) is never one of them."""
    steps = [s for s in steps if s.get("step", 0) >= 1]  # step 0: an evaluation before training
    if len(steps) > 1:
        steps = steps[:1] + [s for s in steps[1:] if not s.get("profiled")]
    if len(steps) <= 1:
        return steps, False
    return steps[1:], True


def train_flops_per_token(params: int, *, num_layers: int = 0, hidden_size: int = 0, seq_len: float = 0.0,
                          passes: float = 1.0, attention: bool = False) -> float:
    """Model FLOPs per trained token: passes * 6N (+ 12 * L * d * s with attention)."""
    per = 6.0 * params
    if attention:
        per += 12.0 * num_layers * hidden_size * seq_len
    return passes * per


def summarise_steps(steps: list[dict], *, params: int, num_layers: int, hidden_size: int, weight_bytes: int,
                    sequences_per_step: int, peak_flops: float | None, passes: float = 1.0,
                    roles_by_rank: dict[int, list[str]] | None = None) -> dict[str, Any]:
    """Medians over the measured steps of a run's records (see the module docstring)."""
    measured, warmup_excluded = measured_steps(steps)
    phases = sorted({k.split("/", 1)[1] for s in measured for k in s if k.startswith("time/")})
    seconds = {p: _median(s[f"time/{p}"] for s in measured if f"time/{p}" in s) for p in phases}
    phase_steps = {p: sum(f"time/{p}" in s for s in measured) for p in phases}

    def per_step(fn) -> float | None:
        return _median_per_step(measured, fn)

    def raw(s: dict) -> float:  # the raw-engine baseline's generation inside the sample phase, if on
        return s.get("time/sample_raw_engine", 0.0)

    step_s = per_step(lambda s: s["time/step"] - s.get("time/eval", 0.0) - raw(s))
    if any("time/sample_raw_engine" in s for s in measured):
        seconds["sample"] = per_step(lambda s: s["time/sample"] - raw(s))
    rollout_tps = per_step(lambda s: s["tokens/response"] / (s["time/sample"] - raw(s)))
    train_tps = per_step(lambda s: s["tokens/total"] / s["time/train"])

    def mfu(attention: bool):
        if not peak_flops:
            return None
        return per_step(lambda s: train_flops_per_token(
            params, num_layers=num_layers, hidden_size=hidden_size,
            seq_len=s["tokens/total"] / sequences_per_step, passes=passes, attention=attention)
            * s["tokens/total"] / (s["time/train"] * peak_flops))

    sync_gbps = per_step(lambda s: weight_bytes / 1e9 / s["time/sync"])

    return {
        "steps": [s["step"] for s in steps],
        "measured_steps": [s["step"] for s in measured],
        "warmup_excluded": warmup_excluded,
        "seconds": seconds,
        "phase_steps": phase_steps,
        "step_s": step_s,
        "sample_s": seconds.get("sample"),
        "train_s": seconds.get("train"),
        "sync_s": seconds.get("sync"),
        "tokens_response": _median(s.get("tokens/response") for s in measured),
        "tokens_total": _median(s.get("tokens/total") for s in measured),
        "rollout_tokens_per_s": rollout_tps,
        "train_tokens_per_s": train_tps,
        "train_mfu": mfu(False),
        "train_mfu_with_attention": mfu(True),
        "sync_gb_per_s": sync_gbps,
        # the sampler's rank's share of the sync: waking its engines, taking the weights in (of which
        # the engines' processing after the last bucket), checksums (of which the engine's, and the
        # slowest policy stage's own, beside it)
        "sync_parts_s": {part: _median(s.get(f"time/sync/{part}") for s in measured)
                         for part in SYNC_PARTS},
        "memory_peak_gb": _memory_peaks(steps, roles_by_rank),
    }


def _median_per_step(measured: list[dict], fn) -> float | None:
    """The median of ``fn(step record)`` over the measured steps, leaving out the steps it cannot
    be computed for (a figure missing, a zero time) and those it gives None for."""
    out = []
    for s in measured:
        try:
            v = fn(s)
        except (KeyError, ZeroDivisionError, TypeError):
            continue
        if v is not None:
            out.append(v)
    return _median(out)


def _memory_peaks(steps: list[dict], roles_by_rank: dict[int, list[str]] | None = None) -> dict[str, Any]:
    """Peak memory over every step (not only the measured ones): the overall ``max``, each rank's
    (``by_rank``, with the roles it holds) and each role's (``by_role``: the peak of its rank)."""
    memory: dict[str, Any] = {}
    for s in steps:
        for k, v in s.items():
            if k.startswith("memory/peak_gb/rank"):
                rank = int(k.rsplit("rank", 1)[1])
                memory[rank] = max(memory.get(rank, 0.0), float(v))
    by_rank = {f"rank{r}": {"roles": (roles_by_rank or {}).get(r, []), "peak_gb": gb}
               for r, gb in sorted(memory.items())}
    by_role: dict[str, float] = {}
    for r, gb in memory.items():
        for role in (roles_by_rank or {}).get(r, []):
            by_role[role] = max(by_role.get(role, 0.0), gb)
    overall = [float(s["memory/peak_gb"]) for s in steps if "memory/peak_gb" in s]
    return {"max": max(overall) if overall else None, "by_rank": by_rank, "by_role": by_role}


def _timer_sum(record: dict, suffixes: tuple[str, ...]) -> float | None:
    vals = [v for k, v in record.get("profiling", {}).items() if k.endswith(suffixes)]
    return sum(vals) if vals else None


def summarise_trl_steps(steps: list[dict], responses_per_step: int | None = None) -> dict[str, Any]:
    """The TRL baseline's per-step records ({"step", "time/step", "profiling": {timer: s}, "logs"}):
    medians over the steps after the first of the step, of TRL's own timers, of its generation
    ("*.generate" timers) and weight sync ("*sync_weights"), and rollout tokens/s = responses x
    completions/mean_length / generation seconds."""
    measured, warmup_excluded = measured_steps(steps)
    names = sorted({n for s in measured for n in s.get("profiling", {})})
    generate = ("generate", "generate_batch")

    def rollout_tps(s: dict) -> float | None:
        gen = _timer_sum(s, generate)
        length = s.get("logs", {}).get("completions/mean_length")
        if not gen or length is None or not responses_per_step:
            return None
        return responses_per_step * length / gen

    return {
        "steps": [s["step"] for s in steps],
        "measured_steps": [s["step"] for s in measured],
        "warmup_excluded": warmup_excluded,
        "step_s": _median(s.get("time/step") for s in measured),
        "sample_s": _median(_timer_sum(s, generate) for s in measured),
        "sync_s": _median(_timer_sum(s, ("sync_weights",)) for s in measured),
        "rollout_tokens_per_s": _median(rollout_tps(s) for s in measured),
        "profiling_s": {n: _median(s["profiling"].get(n) for s in measured if n in s.get("profiling", {}))
                        for n in names},
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def trl_ratios(result: dict) -> dict[str, float | None]:
    """TRL's figure / rlft's for every figure both runs measured (s/step > 1: rlft is faster)."""
    r = (result.get("rlft") or {}).get("summary") or {}
    t = (result.get("trl") or {}).get("summary") or {}
    return {f"trl_over_rlft_{k}": ratio(t.get(k), r.get(k))
            for k in ("step_s", "sample_s", "sync_s", "rollout_tokens_per_s") if t.get(k) is not None}


# ---------------------------------------------------------------- the printed table and summary.json


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if unit == "%":
            return f"{100 * v:.1f} %"
        return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def format_table(result: dict) -> str:
    """A short table of the headline figures: rlft, the TRL baseline (when run) and their ratio."""
    r = (result.get("rlft") or {}).get("summary") or {}
    t = (result.get("trl") or {}).get("summary") or {}
    rows = [
        ("s / step", r.get("step_s"), t.get("step_s"), ""),
        ("sample s", r.get("sample_s"), t.get("sample_s"), ""),
        ("train s", r.get("train_s"), None, ""),
        ("sync s", r.get("sync_s"), t.get("sync_s"), ""),
        *((f"  sync {part} s", v, None, "") for part, v in (r.get("sync_parts_s") or {}).items() if v is not None),
        ("rollout tokens/s", r.get("rollout_tokens_per_s"), t.get("rollout_tokens_per_s"), ""),
        ("train tokens/s", r.get("train_tokens_per_s"), None, ""),
        ("train MFU (6N)", r.get("train_mfu"), None, "%"),
        ("train MFU (+attn)", r.get("train_mfu_with_attention"), None, "%"),
        ("sync GB/s", r.get("sync_gb_per_s"), None, ""),
        ("peak memory GiB", (r.get("memory_peak_gb") or {}).get("max"), None, ""),
    ]
    head = ("metric", "rlft", "trl", "trl / rlft")
    lines = [head]
    for name, a, b, unit in rows:
        lines.append((name, _fmt(a, unit), _fmt(b, unit), _fmt(ratio(b, a)) if b is not None else "-"))
    widths = [max(len(row[i]) for row in lines) for i in range(4)]
    out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
           for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    w = result.get("workload", {})
    m = result.get("model", {})
    title = (f"{m.get('spec')} ({_fmt(m.get('params'))} params), {w.get('name')}: {w.get('prompts')} prompts x "
             f"{w.get('group_size')} x {w.get('tokens')} tokens; {result.get('machine', {}).get('gpu')}; "
             f"medians over steps {(r.get('measured_steps') or ['-'])[0]}..{(r.get('measured_steps') or ['-'])[-1]}")
    trl = result.get("trl") or {}
    notes = [f"trl: {trl.get('status')}{': ' + trl['reason'] if trl.get('reason') else ''}"] if trl else []
    raw = result.get("raw_engine") or {}
    if raw:
        tps = (raw.get("summary") or {}).get("tokens_per_s")
        notes.append(f"raw engine (vLLM LLM.generate, same work): {raw.get('status')}"
                     + (f", {_fmt(tps)} tokens/s; rlft's rollout tokens/s {_fmt(r.get('rollout_tokens_per_s'))} = "
                        f"{_fmt(ratio(r.get('rollout_tokens_per_s'), tps))} x raw" if tps else "")
                     + (f": {raw['reason']}" if raw.get("reason") else ""))
    return "\n".join([title, *out, *notes])


def headline(result: dict) -> dict[str, float | None]:
    """The summary.json entry of one run."""
    r = (result.get("rlft") or {}).get("summary") or {}
    trl = result.get("trl") or {}
    t = trl.get("summary") or {}
    vllm = trl.get("use_vllm", True)
    out = {
        "rlft_s_per_step": r.get("step_s"),
        "trl_vllm_s_per_step": t.get("step_s") if vllm else None,
        "trl_over_rlft": ratio(t.get("step_s"), r.get("step_s")),
        "train_mfu": r.get("train_mfu"),
        "sync_s": r.get("sync_s"),
        "sync_parts_s": r.get("sync_parts_s"),
        "sample_s": r.get("sample_s"),
        "train_s": r.get("train_s"),
        "rollout_tokens_per_s": r.get("rollout_tokens_per_s"),
        "raw_engine_tokens_per_s": ((result.get("raw_engine") or {}).get("summary") or {}).get("tokens_per_s"),
        "train_tokens_per_s": r.get("train_tokens_per_s"),
        "gpu": result.get("machine", {}).get("gpu"),
        "commit": (result.get("commit") or {}).get("sha"),
    }
    if t and not vllm:  # TRL generating with transformers (no vLLM here, e.g. on CPU)
        out["trl_hf_s_per_step"] = t.get("step_s")
    return out


def merge_summary(path: str | Path, key: str, entry: dict) -> dict:
    """Set ``key`` of the JSON object in ``path`` (created when missing) to ``entry``; returns it all."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return data
