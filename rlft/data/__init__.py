"""A run's data: the problems, how a dataset's rows become them, their prompts and the order they are drawn in.

    examples.py         Example and LoadResult: a problem, the rows skipped and why; GSM8K's `####` gold
    sources.py          load_examples: any source; GSM8K files (.jsonl, .parquet, .csv) and hub datasets
    generated.py        gsm_symbolic and reasoning_gym:TASK: problems generated offline for a seed
    rows.py             data.fields / data.adapter: a dataset's rows -> question and gold
    prompts.py          the prompt of a run: R1-Zero text or the tokenizer's chat template; SFT targets
    prompt_samplers.py  data.sampler: the order prompts are drawn in (PromptSampler's uniform, difficulty)

`from rlft.data import Example, LoadResult, load_examples, PromptSampler, ...` finds the names of
loading and the uniform order; they are loaded on first use (PEP 562), so that importing one
submodule (the config reads `rlft.data.prompts`) does not load the others.
"""
from __future__ import annotations

import importlib

# name -> the submodule that defines it
_EXPORTS = {
    **dict.fromkeys((
        "Example", "LoadResult", "plain_number", "parse_gsm8k_ground_truth",
        "SKIP_INVALID_JSON", "SKIP_NOT_UTF8", "SKIP_NOT_AN_OBJECT", "SKIP_MISSING_FIELD", "SKIP_NO_FINAL_ANSWER",
        "SKIP_NON_NUMERIC_ANSWER",
    ), "examples"),
    **dict.fromkeys(("GSM8K_HUB_ID", "rows_from_csv", "load_gsm8k", "load_examples"), "sources"),
    **dict.fromkeys((
        "GSM_SYMBOLIC", "REASONING_GYM_PREFIX", "GSM_SYMBOLIC_TEST_SEED_OFFSET", "GSM_SYMBOLIC_DEFAULT_SIZE",
        "parse_reasoning_gym_source", "load_reasoning_gym", "load_gsm_symbolic",
    ), "generated"),
    "PromptSampler": "prompt_samplers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
