"""No code compares a choice's name outside the module that records it: the losses, estimators, modes,
sources, launchers, engines, environments, finish reasons, LoRA sync modes, weight transports,
learning-rate schedules and trainers (their names and their modules' names) are records (or declared lists) whose properties the rest of rlft reads (`rlft.grpo.choices`,
`rlft.config.launchers`, `rlft.engines.records`, `rlft.envs.registry`, ...).  A comparison such as `g.overlong == "soft_penalty"` elsewhere would leave a
new choice with the same properties treated differently; this finds every `==`, `!=`, `in` and
`not in` with a recorded name in rlft/, the AST's version of

    grep -rnE '(==|!=) "(sequence|token|...|no_ssh)"' rlft
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlft"

# The modules that declare the records (and may name them as they please): module -> which of
# `choice_groups()` it records.
REGISTRIES = {
    "rlft/grpo/choices.py": {"grpo"},
    "rlft/config/launchers.py": {"launchers"},
    "rlft/engines/records.py": {"engines"},
    "rlft/engines/hf_backend.py": {"engines"},
    "rlft/engines/vllm_backend.py": {"engines"},
    "rlft/envs/registry.py": {"environments"},
    "rlft/common.py": {"finish_reasons"},
    "rlft/envs/episodes.py": {"finish_reasons"},
    "rlft/config/schema.py": {"sync_modes"},
    "rlft/engines/vllm_sender.py": {"weight_transports"},  # the sender's and the worker's two sides
    "rlft/engines/vllm_worker.py": {"weight_transports"},
    "rlft/config/lr_schedules.py": {"schedules"},
    "rlft/config/trainers.py": {"trainers"},
}

# Comparisons with a string that is also some choice's name, but says something else there: (module,
# a piece of the comparison's text) -> why it is not a choice's name.
UNRELATED = {
    ("rlft/bench/trl_baseline.py", 'kwargs.get("scale_rewards")'): "TRL's GRPOConfig.scale_rewards value",
    ("rlft/config/role_records.py", "reference_logprobs_by(cfg, training.objective) =="): "who computes the reference log-probs, a role's name",
    ("rlft/roles/policy.py", "reference_logprobs_by(self.cfg, self.objective) =="): "who computes the reference log-probs, a role's name",
    ("rlft/config/topology.py", 'name == "policy"'): "the policy role's name, not an old log-probs source",
    ("rlft/engines/vllm_requests.py", 'reason == "stop"'): "vLLM's own CompletionOutput.finish_reason, read into rlft's",
    ("rlft/engines/vllm_requests.py", 'reason not in ("stop", "length")'): "vLLM's own CompletionOutput.finish_reason values",
    ("rlft/engines/vllm_worker.py", '"vllm" in sys.modules'): "the vllm package's module name, not the engine's",
    ("rlft/runtime/bridge.py", 'backend == "gloo"'): "torch.distributed's backend, not a weight transport",
}


def choice_groups() -> dict[str, set[str]]:
    """Every name recorded in a registry of choices (and the names the first search listed), by group."""
    from rlft.config.launchers import LAUNCHERS
    from rlft.config.lr_schedules import LR_SCHEDULES
    from rlft.config.schema import LORA_SYNC_MODES
    from rlft.config.trainers import TRAINERS
    from rlft.engines import BACKENDS
    from rlft.engines.base import FINISH_REASONS as ENGINE_FINISH_REASONS
    from rlft.engines.vllm_sender import TRANSPORTS
    from rlft.envs.episodes import FINISH_REASONS as EPISODE_FINISH_REASONS
    from rlft.envs.registry import ENVIRONMENTS
    from rlft.grpo import (
        ADVANTAGE_ESTIMATORS,
        AGGREGATION_MODES,
        KL_ESTIMATORS,
        OLD_LOGPROB_SOURCES,
        OVERLONG_MODES,
        POLICY_LOSSES,
        ROLLOUT_IS_MODES,
    )

    grpo = {"sequence", "token", "constant", "filter", "soft_penalty", "none", "tis", "policy", "reference",
            "no_baseline", "grpo_clip", "dapo", "gspo", "reinforce_with_baseline"}
    for registry in (POLICY_LOSSES, ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, AGGREGATION_MODES, OVERLONG_MODES,
                     ROLLOUT_IS_MODES, OLD_LOGPROB_SOURCES):
        grpo |= set(registry)
    groups = {"grpo": grpo, "launchers": {"pdsh", "slurm", "no_ssh", "openmpi"} | set(LAUNCHERS),
              "engines": set(BACKENDS), "environments": set(ENVIRONMENTS),
              "finish_reasons": set(ENGINE_FINISH_REASONS) | set(EPISODE_FINISH_REASONS),
              "sync_modes": set(LORA_SYNC_MODES), "schedules": set(LR_SCHEDULES),
              "weight_transports": set(TRANSPORTS) - {"auto"},  # auto: every setting's word for "decided at start"
              "trainers": {"grpo", "sft", "rlft.train_grpo", "rlft.train_sft"} | set(TRAINERS)
              | {t.module for t in TRAINERS.values()}}
    assert {"hf", "vllm"} <= groups["engines"] and {"single_turn", "calculator"} <= groups["environments"]
    assert {"length", "max_turns"} <= groups["finish_reasons"] and groups["schedules"] == {"constant", "cosine"}
    return groups


def choice_names(module: str = "") -> set[str]:
    """The names `module` may not compare: every group's but those it records itself."""
    own, groups = REGISTRIES.get(module, set()), choice_groups()
    owned = {name for group in own for name in groups[group]}
    return {name for group, names in groups.items() if group not in own for name in names} - owned


def _strings(node: ast.AST) -> list[str]:
    """The string constants a comparison operand is, or holds (a tuple, list or set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for element in node.elts for s in _strings(element)]
    return []


def name_comparisons(path: Path, relative: str, names: set[str]) -> list[str]:
    """`relative:line: text` of each comparison in `path` with a string of `names`, unless UNRELATED."""
    source = path.read_text(encoding="utf-8")
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        if not any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            continue
        compared = {s for operand in (node.left, *node.comparators) for s in _strings(operand)} & names
        text = ast.get_source_segment(source, node) or ""
        if compared and not any(module == relative and piece in text for module, piece in UNRELATED):
            found.append(f"{relative}:{node.lineno}: {text}")
    return found


def test_no_choice_name_is_compared_outside_its_registry():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).as_posix()
        found += name_comparisons(path, relative, choice_names(relative))
    assert not found, "compare the record's properties instead:\n" + "\n".join(found)


def test_the_search_finds_each_form_of_comparison(tmp_path):
    code = tmp_path / "mode_by_name.py"
    code.write_text('if g.overlong == "soft_penalty":\n    pass\n'
                    'x = "tis" != g.rollout_is\n'
                    'y = g.old_logprobs in ("policy", "reference")\n'
                    'z = t.launcher not in ["pdsh"]\n'
                    'ok = g.overlong == OVERLONG\n'  # a name, not a string: not found
                    'fine = {"token": 1}["token"]\n'  # no comparison
                    'cut = reason == "length"\n'
                    'fast = cfg.sampling.backend in ("vllm",)\n'
                    'tools = cfg.environment.name != "calculator"\n'
                    'lora = cfg.model.lora.sync == "adapter"\n'
                    'lr = "cosine" == cfg.optim.lr_schedule\n'
                    'grpo = module == "rlft.train_grpo"\n'
                    'sft = args.trainer in ("sft",)\n')
    found = name_comparisons(code, "rlft/mode_by_name.py", choice_names("rlft/mode_by_name.py"))
    assert [line.split(":")[1] for line in found] == ["1", "3", "4", "5", "8", "9", "10", "11", "12", "13", "14"]
    # A registry's module may compare its own names, and no other group's.
    in_common = name_comparisons(code, "rlft/common.py", choice_names("rlft/common.py"))
    assert [line.split(":")[1] for line in in_common] == ["1", "3", "4", "5", "9", "10", "11", "12", "13", "14"]
    # The listed unrelated comparisons are still there, each once (a stale entry would hide nothing).
    for module, piece in UNRELATED:
        assert (PACKAGE.parent / module).read_text(encoding="utf-8").count(piece) == 1, (module, piece)
