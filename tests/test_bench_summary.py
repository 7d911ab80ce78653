"""The benchmark figures the README and the results' READMEs quote are the ones
`benchmarks/results/summary.json` holds: each quote below is written with placeholders
`{entry/key/...:format}` (`*100` or `*0.001` scales, a leading `-` negates), filled from summary.json and
looked for in its page with runs of whitespace read as one space.  A figure changed on one side only
fails here; so does an entry without its command, commit, GPU and details."""
from __future__ import annotations

import json
import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SUMMARY = RESULTS / "summary.json"
PLACEHOLDER = re.compile(r"\{(-?)([\w./-]+?)(?:\*([\d.]+))?:([^{}]+)\}")

TRL = "h200_2026-12-03_trl_ablation/README.md"
FP8_LORA = "h200_2026-12-03_fp8_lora/README.md"
DEFAULTS = "h200_2026-12-03_defaults/README.md"
ROUNDS = "h100_2026-12-05_round_size/README.md"
CHECKS = "h100_2026-12-06_checks/README.md"
SUITE = "cpu_2026-12-07_suite/README.md"
P, B, A = "one_shape_sample_phase_h100", "one_shape_sample_phase_h100/before", "one_shape_sample_phase_h100/after"
W, OLD, I = "w_big_1gpu", "w_big_1gpu/previous", "w_big_1gpu_interleaved"
FAMILY_GPU = "h100_2026-12-07_families/README.md"
FS, IR = "family_records_step_h100", "instruct_recipe_h100_2026-12-07"
QUOTES = [
    ("cpu_2026-12-07_tool_block/README.md", "| of which the calculator's JSON schema (`rlft/envs/calculator.py`) | "
                                            "{tool_block_tokens/schema_tokens:.0f} |"),
    ("cpu_2026-12-07_tool_block/README.md", "| the tool block the template adds when the calculator is offered | "
                                            "{tool_block_tokens/tool_block_tokens:.0f} |"),
    (SUITE, "| before (4985da4^) | {policy_rank_muon_import/before_cpu_s_median:.2f} | "
            "{policy_rank_muon_import/before_wall_s_median:.2f} |"),
    (SUITE, "| after (4985da4) | {policy_rank_muon_import/after_cpu_s_median:.2f} | "
            "{policy_rank_muon_import/after_wall_s_median:.2f} |"),
    # The model families' checks on one H100: the step before and after, the instruct recipe.
    ("README.md", f"took {{{FS}/after_over_before/s_per_step:.3f}}× the step before the family records "
                  f"({{{FS}/after/s_per_step:.3f}} s against {{{FS}/before/s_per_step:.3f}} s)"),
    ("README.md", f"instruct recipe went {{{IR}/before*100:.1f}} % → **{{{IR}/after*100:.1f}} %** in {{{IR}/after_step:.0f}} "
                  f"steps ({{{IR}/minutes:.1f}} min;"),
    (FAMILY_GPU, f"| s / step | {{{FS}/before/s_per_step:.3f}} | {{{FS}/after/s_per_step:.3f}} | "
                 f"{{{FS}/after_over_before/s_per_step:.3f}} |"),
    (FAMILY_GPU, f"| train s (MFU) | {{{FS}/before/train_s:.3f}} ({{{FS}/before/train_mfu*100:.1f}} %) | "
                 f"{{{FS}/after/train_s:.3f}} ({{{FS}/after/train_mfu*100:.1f}} %) | {{{FS}/after_over_before/train_s:.3f}} |"),
    (FAMILY_GPU, f"| 35 | **{{{IR}/after*100:.1f}} %** ({{{IR}/minutes:.1f}} min) |"),
    (FAMILY_GPU, f"{{{IR}/gained:.0f}} gained, {{{IR}/lost:.0f}} lost"),
    # The README's table: the one-GPU set of h200_2026-12-03_bench5.
    ("README.md", f"| s / step | **{{{OLD}/rlft_s_per_step:.2f}}** | {{w_big_1gpu_awake/rlft_s_per_step:.2f}} | | "
                  f"{{{OLD}/trl_vllm_s_per_step:.2f}} | rlft ≤ 0.5 × TRL: **{{{OLD}/rlft_over_trl:.2f}} ×** |"),
    ("README.md", f"| sample s (tokens/s) | {{{OLD}/sample_s:.2f}} ({{{OLD}/rollout_tokens_per_s*0.001:.1f}}k) | "
                  f"{{w_big_1gpu_awake/sample_s:.2f}} ({{w_big_1gpu_awake/rollout_tokens_per_s*0.001:.1f}}k) | "
                  f"{{{OLD}/raw_engine_sample_s:.2f}} ({{{OLD}/raw_engine_tokens_per_s*0.001:.1f}}k) | "
                  f"{{{OLD}/trl_sample_s:.2f}} ({{{OLD}/trl_rollout_tokens_per_s*0.001:.1f}}k) | ≥ 0.9 × raw: "
                  f"**{{{OLD}/rollout_over_raw_engine:.2f}} ×** (second machine: "
                  f"**{{{OLD}/second_machine/rollout_over_raw_engine:.2f}} ×**, "
                  f"{{{OLD}/second_machine/rollout_tokens_per_s*0.001:.1f}}k against "
                  f"{{{OLD}/second_machine/raw_engine_tokens_per_s*0.001:.1f}}k) |"),
    ("README.md", f"| train s | {{{OLD}/train_s:.2f}} (**MFU {{{OLD}/train_mfu*100:.1f}} %**) | "
                  f"{{w_big_1gpu_awake/train_s:.2f}} (MFU {{w_big_1gpu_awake/train_mfu*100:.1f}} %) |"),
    ("README.md", f"(second machine {{{OLD}/second_machine/train_mfu*100:.1f}} %)"),
    ("README.md", f"| sync s | {{{OLD}/sync_s:.3f}} (wake {{{OLD}/sync_parts_s/wake:.3f}}, load "
                  f"{{{OLD}/sync_parts_s/load:.3f}}, checksums {{{OLD}/sync_parts_s/checksum:.3f}}) | "
                  f"**{{w_big_1gpu_awake/sync_s:.3f}}** (load {{w_big_1gpu_awake/sync_parts_s/load:.3f}}, checksums "
                  f"{{w_big_1gpu_awake/sync_parts_s/checksum:.3f}}) | | {{{OLD}/trl_sync_s:.3f}} |"),
    ("README.md", "compiled: **MFU {sft_1p5b_compiled/mfu*100:.1f} %**, {sft_1p5b_compiled/s_per_step:.2f} s/step"),
    ("README.md", "takes {sync_1p5b_1gpu/load_s_by_bucket_mib/256*1000:.0f} ms in buckets of 256 MiB and "
                  "{sync_1p5b_1gpu/load_s_by_bucket_mib/1024*1000:.0f} ms in buckets of 1 GiB"),
    ("README.md", "{sync_1p5b_1gpu/checksums_side_by_side_s*1000:.0f} ms side by side, against "
                  "{sync_1p5b_1gpu/checksum_policy_float64_cast_s*1000:.0f} ms"),
    # The notes below it: the later runs.
    ("README.md", f"the sync took **{{{I}/previous/sync_s:.3f}} s**"),
    ("README.md", f"sample phase was **{{{I}/rollout_over_raw_engine:.3f}} ×** the raw engine's speed at the median "
                  f"({{{I}/rollout_over_raw_engine_min:.3f}}–{{{I}/rollout_over_raw_engine_max:.3f}}), its step "
                  f"{{{I}/rlft_s_per_step:.2f}} s, its sync {{{I}/sync_s:.3f}} s"),
    ("README.md", f"rlft as shipped **{{{W}/rlft_s_per_step:.2f}} s a step, TRL {{{W}/trl_vllm_s_per_step:.2f}} s: "
                  f"{{{W}/rlft_over_trl:.3f}} ×** (target ≤ 0.45 ×; {{{W}/rlft_over_trl_with_eval:.3f}} × "
                  f"counting the evaluation one step ran). Sample {{{W}/sample_s:.2f}} against {{{W}/trl_sample_s:.2f}} s, sync "
                  f"{{{W}/sync_s:.3f}} against {{{W}/trl_sync_s:.3f}} s, train MFU {{{W}/train_mfu*100:.1f}} %"),
    ("README.md", "sampled {-fp8_rollouts/fp8_gain/random-0.5b*100:.1f} % slower at the 0.5B shape and "
                  "{-fp8_rollouts/fp8_gain/random-1.5b*100:.1f} % slower at 1.5B"),
    ("README.md", "writing and loading the adapter ({lora_engine_0p5b/adapter_write_median_s:.2f} + "
                  "{lora_engine_0p5b/adapter_load_median_s:.2f} s)"),
    ("README.md", "(256 / 512 / 640 sequences of 512 tokens: {round_size_0p5b/round_s_by_sequences/graphs/256:.1f} / "
                  "{round_size_0p5b/round_s_by_sequences/graphs/512:.1f} / "
                  "{round_size_0p5b/round_s_by_sequences/graphs/640:.1f} s)"),
    ("README.md", "({round_size_0p5b/round_s_by_sequences/default/640:.1f} s for 640)"),
    # The results' own pages.
    (TRL, f"| s / step | **{{{W}/rlft_s_per_step:.2f}}** ({{{W}/rlft_s_per_step_with_eval:.2f}} with the evaluation "
          f"one step ran; steps 13.76–14.54) | **{{{W}/trl_vllm_s_per_step:.2f}}** (29.81–34.02) | "
          f"**{{{W}/rlft_over_trl:.3f}}** ({{{W}/rlft_over_trl_with_eval:.3f}} with the evaluation) |"),
    (TRL, f"| sample s (rollout tokens/s) | {{{W}/sample_s:.2f}} ({{{W}/rollout_tokens_per_s*0.001:.1f}}k) | "
          f"{{{W}/trl_sample_s:.2f}} ({{{W}/trl_rollout_tokens_per_s*0.001:.1f}}k) |"),
    (TRL, f"| train s (MFU, 6N) | {{{W}/train_s:.2f}} ({{{W}/train_mfu*100:.1f}} %) |"),
    (TRL, f"| sync s | {{{W}/sync_s:.3f}} (load {{{W}/sync_parts_s/load:.3f}}, checksums "
          f"{{{W}/sync_parts_s/checksum:.3f}}) | {{{W}/trl_sync_s:.3f}} | |"),
    (TRL, f"{{{W}/gpu_memory_used_peak_gib:.1f}} GiB (torch's peak allocated"),
    (FP8_LORA, f"| rlft's sample phase / the raw engine's (raw s / rlft s) | **{{{I}/rollout_over_raw_engine:.3f}}** | "
               f"{{{I}/rollout_over_raw_engine_min:.3f}}-{{{I}/rollout_over_raw_engine_max:.3f}} |"),
    (FP8_LORA, f"| rlft sample s | {{{I}/sample_s:.2f}} |"),
    (FP8_LORA, f"| raw engine s | {{{I}/raw_engine_sample_s:.2f}} |"),
    (FP8_LORA, f"| step s (the raw engine's generation left out) | {{{I}/rlft_s_per_step:.2f}} |"),
    (FP8_LORA, f"| sync s (engine awake: no wake) | {{{I}/sync_s:.3f}} |"),
    (FP8_LORA, f"| train MFU (6N) | {{{I}/train_mfu*100:.1f}} % |"),
    (FP8_LORA, "| 0.5B shape | {fp8_rollouts/bf16_median_s/random-0.5b:.2f} (5.25-6.03) | "
               "{fp8_rollouts/fp8_median_s/random-0.5b:.2f} (5.31-7.20) | **{fp8_rollouts/fp8_gain/random-0.5b*100:.1f} %** |"),
    (FP8_LORA, "| 1.5B shape | {fp8_rollouts/bf16_median_s/random-1.5b:.2f} (5.35-7.26) | "
               "{fp8_rollouts/fp8_median_s/random-1.5b:.2f} (4.97-7.78) | **{fp8_rollouts/fp8_gain/random-1.5b*100:.1f} %** |"),
    (FP8_LORA, "| {lora_engine_0p5b/plain_median_s:.2f} (3.10-4.14) | {lora_engine_0p5b/lora_median_s:.2f} (3.42-3.92): "
               "**+{lora_engine_0p5b/lora_sample_cost*100:.1f} %** |"),
    (FP8_LORA, "({lora_engine_0p5b/adapter_write_median_s:.3f} + "
               "{lora_engine_0p5b/adapter_load_median_s:.3f} s)"),
    (DEFAULTS, f"| **median** | **{{{I}/previous/sample_s:.3f}}** | **{{{I}/previous/raw_engine_sample_s:.3f}}** | "
               f"**{{{I}/previous/rollout_over_raw_engine:.3f}}** ({{{I}/previous/rollout_over_raw_engine_min:.3f}}–"
               f"{{{I}/previous/rollout_over_raw_engine_max:.3f}}) | **{{{I}/previous/rlft_s_per_step:.2f}}** | "
               f"**{{{I}/previous/sync_s:.3f}}** |"),
    (ROUNDS, "| 32 (256) | {round_size_0p5b/round_s_by_sequences/default/256:.2f} s (5.83, 6.27) | "
             "{round_size_0p5b/round_s_by_sequences/graphs/256:.2f} s (5.89, 6.09) |"),
    (ROUNDS, "| 64 (512) | {round_size_0p5b/round_s_by_sequences/default/512:.2f} s (9.98, 9.81) | "
             "{round_size_0p5b/round_s_by_sequences/graphs/512:.2f} s (10.01, 10.14) |"),
    (ROUNDS, "| 80 (640) | **{round_size_0p5b/round_s_by_sequences/default/640:.2f} s** (23.45, 26.30) | "
             "**{round_size_0p5b/round_s_by_sequences/graphs/640:.2f} s** (11.59, 12.87) |"),
    (CHECKS, f"| sample s | {{{B}/time_sample:.2f}} | {{{A}/time_sample:.2f}} | {{{P}/after_first_launch/time_sample:.2f}} |"),
    (CHECKS, f"| sample tokens/s | {{{B}/throughput_sample_tokens_per_s:,.0f}} | {{{A}/throughput_sample_tokens_per_s:,.0f}} |"),
    (CHECKS, "**{one_shape_sample_phase_h100/sample_tokens_per_s_ratio:.2f}× the tokens per second of before**"),
    (CHECKS, "was {one_shape_sample_phase_h100/same_tree_launch_ratio:.2f}× slower than its second"),
    (CHECKS, "| episodes with a tool call | 6.2 % (first GRPO step) | **{tools_coldstart_0p5b/eval/tool_call_rate*100:.1f} %** |"),
    (CHECKS, "| well-formed calls | 0–3 % | **{tools_coldstart_0p5b/eval/well_formed_rate*100:.1f} %** |"),
    (CHECKS, "| accuracy | 24.6 % | **{tools_coldstart_0p5b/eval/accuracy*100:.1f} %** |"),
    (CHECKS, "**{w_big_1gpu_h100/rlft_s_per_step:.2f} s a step** (sample {w_big_1gpu_h100/sample_s:.2f}, train "
             "{w_big_1gpu_h100/train_s:.2f}), train MFU {w_big_1gpu_h100/train_mfu*100:.1f} %"),
    (CHECKS, "**sync {w_big_1gpu_h100/sync_s:.3f} s, of which the engine's wake {w_big_1gpu_h100/sync_parts_s/wake:.3f} s**"),
    ("README.md", "so its sync takes {w_big_1gpu_h100/sync_s:.3f} s, {w_big_1gpu_h100/sync_parts_s/wake:.3f} s of it the wake, "
                  "against {w_big_1gpu/sync_s:.3f} s on an H200"),
    ("README.md", "a tiny model's engine starts in {cpu_engine_in_process/in_engine/start_s:.1f} s instead of "
                  "{cpu_engine_in_process/worker_process/start_s:.1f} s, with {cpu_engine_in_process/in_engine/cpu_s_until_close:.1f} "
                  "CPU-s instead of {cpu_engine_in_process/worker_process/cpu_s_until_close:.1f}"),
    (SUITE, "| start, s | {cpu_engine_in_process/in_engine/start_s:.1f} | {cpu_engine_in_process/worker_process/start_s:.1f} | "
            "{cpu_engine_in_process/ratio_in_engine_over_worker_process/start_s:.2f} |"),
    (SUITE, "| CPU-s until the close | {cpu_engine_in_process/in_engine/cpu_s_until_close:.1f} | "
            "{cpu_engine_in_process/worker_process/cpu_s_until_close:.1f} | "
            "{cpu_engine_in_process/ratio_in_engine_over_worker_process/cpu_s_until_close:.2f} |"),
]


def summary() -> dict:
    return json.loads(SUMMARY.read_text(encoding="utf-8"))


def figure(data: dict, path: str):
    value = data
    for key in path.split("/"):
        assert isinstance(value, dict) and key in value, f"summary.json has no {path} (at {key!r})"
        value = value[key]
    return value


def filled(template: str, data: dict) -> str:
    def one(m: re.Match) -> str:
        value = figure(data, m.group(2))
        assert isinstance(value, (int, float)), f"summary.json's {m.group(2)} is {value!r}, not a figure"
        value = value * float(m.group(3) or 1) * (-1 if m.group(1) else 1)
        fixed = re.fullmatch(r"\.(\d+)f", m.group(4))
        if fixed:  # as a person rounds the decimal figure: 9.895 -> 9.90 (binary rounding gives 9.89)
            return str(Decimal(repr(value)).quantize(Decimal(1).scaleb(-int(fixed.group(1))), ROUND_HALF_UP))
        return format(value, m.group(4))
    return PLACEHOLDER.sub(one, template)


def spaced(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("page,template", QUOTES, ids=[f"{p}:{i}" for i, (p, _) in enumerate(QUOTES)])
def test_each_quoted_figure_is_the_one_summary_json_holds(page, template):
    path = REPO / page if page == "README.md" else RESULTS / page
    quote = filled(template, summary())
    assert spaced(quote) in spaced(path.read_text(encoding="utf-8")), f"{page} does not quote {quote!r}"


def test_the_headline_figures_are_the_latest_runs():
    # The figures the README leads with: 0.436 x TRL on one machine, 1.128 x the raw engine, sync 0.074 s.
    data = summary()
    assert f"{data['w_big_1gpu']['rlft_over_trl']:.3f}" == "0.436"
    assert f"{data['w_big_1gpu_interleaved']['rollout_over_raw_engine']:.3f}" == "1.128"
    assert f"{data['w_big_1gpu']['sync_s']:.3f}" == f"{data['w_big_1gpu_interleaved']['sync_s']:.3f}" == "0.074"


def test_every_measured_entry_says_how_it_was_made():
    for key, entry in summary().items():
        if key == "notes" or entry is None:
            continue
        for made in (entry, entry.get("previous") or {}):
            if made:
                missing = {"command", "commit", "gpu", "details"} - set(made)
                assert not missing, f"summary.json {key}: no {sorted(missing)}"
                assert (REPO / made["details"]).is_file(), f"summary.json {key}: {made['details']} is missing"
                if "source" in made:
                    assert (REPO / made["source"]).is_file(), f"summary.json {key}: {made['source']} is missing"


def test_a_quote_that_disagrees_is_caught():
    data = {"a": {"b": 0.4362, "c": -0.096}}
    assert filled("x {a/b:.3f} ×, {-a/c*100:.1f} %", data) == "x 0.436 ×, 9.6 %"
    assert filled("{a/e:.2f} {a/e:.1f} {a/f:.0f}", {"a": {"e": 9.895, "f": 41.5}}) == "9.90 9.9 42"
    assert spaced("rlft as\n  shipped") == "rlft as shipped"
    with pytest.raises(AssertionError, match="no a/d"):
        filled("{a/d:.2f}", data)
