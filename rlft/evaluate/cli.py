"""Evaluate a model on GSM8K-style maths from the command line.

    python -m rlft.evaluate --model runs/grpo/model --data gsm8k:test --num-examples 200

``--data`` takes ``gsm8k[:split]`` (the hub's ``openai/gsm8k``), ``gsm_symbolic[:split]`` or
``reasoning_gym:TASK[?key=value&...][:split]`` (offline generators), a hub id ``org/name[:split]``,
or a local ``.jsonl``/``.parquet``/``.csv`` file or dataset directory, optionally followed by ``:split``
(default ``test``). Repeat ``--data`` to score several sets with one engine start. Results go to
``--out`` (``--out/<data label>`` for each of several sets; default:
``<model dir>/eval_<data>_<timestamp>``, or ``runs/eval/eval_<model>_<data>_<timestamp>`` when the
model is not a local directory) as ``results.jsonl`` and ``summary.json``. ``accuracy`` is strict
(the answer format's contract, what the reward pays); ``accuracy_lenient`` beside it counts a response
right when its last marked answer or last number is (``rlft.reward.lenient``).

The prompt and the answer format are the training run's: ``--config run.yaml`` takes its
``data.prompt_template`` / ``system_prompt`` / ``prompt_messages``, ``reward.answer_format``, how its
data's rows map to question and gold (``data.fields``, ``data.adapter``, ``data.hub_config``; e.g. a
MATH-style ``problem`` / ``solution`` file whose answer is the last ``\\boxed{}``; ``--fields
question=problem,gold=solution,gold_kind=boxed`` says the same without a config) and its
``sampling.repetition_penalty`` / ``min_tokens``
(e.g. ``launch/configs/grpo_instruct_1gpu.yaml``: the model's chat template, answers in
``\\boxed{}``); ``--prompt-template`` and ``--answer-format`` override them (default: the R1-Zero
text prompt and tags). Sampling follows the training configuration's defaults
(``rlft.config.SamplingConfig``: the answer format's stop strings, kept in the output, repetition
penalty 1.1, at least 4 tokens); ``--temperature`` (greedy by default), ``--top-p`` and
``--max-tokens`` override them. The engine gets every question of a set at once (vLLM schedules
them itself); ``--batch-size`` caps that.

A config whose ``environment.name`` is a multi-turn environment (e.g. ``calculator``, with
``environment.evaluate_with_tools`` true) makes every answer an episode of it, as in training: the
model may call the tool, its last turn is graded, and the summary adds the tool figures
(``tool_call_rate``, ``tool_calls_per_episode``, ``tool_errors``, ``accuracy_with_tool``,
``accuracy_without_tool``).  ``--environment NAME`` chooses one (``module:Class`` too, a single-turn one
included: its openings are the prompts), ``--no-tools`` the single-turn one (one answer, no tools).

Bad input (a model or data path that does not exist, an unknown data source, an out-of-range
option) prints one line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from rlft.common import DTYPE_CHOICES, resolve_dtype
from rlft.data.prompts import DEFAULT_PROMPT_TEMPLATE
from rlft.evaluate.inputs import (DataSpec, InputError, default_out_dir, parse_data_arg,  # noqa: F401 (the cli's names)
                                  check_out_dir, parse_fields)
from rlft.reward.formats import ANSWER_FORMATS, DEFAULT_ANSWER_FORMAT, get_answer_format

PROG = "rlft.evaluate"
EXIT_BAD_INPUT = 2


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr (and status 2, as argparse does)."""

    def error(self, message: str):  # noqa: D401 - argparse's signature
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from rlft.config import SamplingConfig
    from rlft.engines import backend_choices

    d = SamplingConfig()
    p = _OneLineParser(prog=f"python -m {PROG}", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="HF model directory, .gguf file, hub id, or 'smollm2-135m-instruct'")
    p.add_argument("--data", action="append", default=None,
                   help="gsm8k[:split] | gsm_symbolic[:split] | reasoning_gym:TASK[?k=v&...][:split] | "
                        "org/name[:split] | PATH[:split] (default: gsm8k:test); repeat it to score several "
                        "sets with one engine start, each into OUT/<data label>")
    p.add_argument("--num-examples", type=int, default=200,
                   help="evaluate the first N examples; 0 = the whole split (default: %(default)s)")
    p.add_argument("--k", type=int, default=1,
                   help="samples per question, and the k of pass@k (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=d.eval_temperature,
                   help="sampling temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=d.top_p, help="nucleus sampling (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="most tokens generated per response (default: %(default)s)")
    p.add_argument("--backend", choices=backend_choices(), default="auto",
                   help="rollout engine; auto = vLLM when installed and supported, else HF generate "
                        "(default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="engine dtype on a GPU; auto = bf16 (CPU runs fp32) (default: %(default)s)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="vLLM on a GPU: the engine's share of the GPU's memory (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="prompts per generate call (default: the whole set at once)")
    p.add_argument("--config", default=None,
                   help="a run's YAML config: its prompt (data.prompt_template, system_prompt, prompt_messages), "
                        "answer format (reward.answer_format) and row mapping (data.fields, data.adapter)")
    p.add_argument("--fields", default=None,
                   help="how the data's rows map to question and gold, overriding the config's data.fields: "
                        "comma-separated question=FIELD, gold=FIELD, gold_kind=gsm8k|boxed|plain "
                        "(e.g. question=problem,gold=solution,gold_kind=boxed)")
    p.add_argument("--prompt-template", default=None,
                   help="registered template name, 'chat' (the model's chat template) or a literal with "
                        f"{{question}} (default: the config's, else {DEFAULT_PROMPT_TEMPLATE})")
    p.add_argument("--answer-format", default=None,
                   help=f"{' | '.join(ANSWER_FORMATS)}: where the answer is (default: the config's, else "
                        f"{DEFAULT_ANSWER_FORMAT})")
    p.add_argument("--environment", default=None,
                   help="answer in episodes of this environment (calculator, a registered name or module:Class; "
                        "default: the config's environment.name when its evaluate_with_tools is true)")
    p.add_argument("--no-tools", action="store_true",
                   help="one answer per question, no tools, whatever the config's environment")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed, and gsm_symbolic's generator seed (default: %(default)s)")
    p.add_argument("--out", default=None, help="output directory (default: see above)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Range checks argparse cannot express; raise InputError naming the option."""
    if args.k < 1:
        raise InputError(f"--k must be >= 1, got {args.k}")
    if args.num_examples < 0:
        raise InputError(f"--num-examples must be >= 0 (0 = all), got {args.num_examples}")
    from rlft.engines.base import check_sampling_ranges

    try:
        check_sampling_ranges({"temperature": args.temperature, "top_p": args.top_p, "max_tokens": args.max_tokens},
                              label=lambda name: "--" + name.replace("_", "-"))
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if not 0 < args.gpu_memory_utilization <= 1:
        raise InputError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.batch_size is not None and args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    args.prompt = build_prompt(args)
    args.rollout_environment = build_environment(args)


def build_prompt(args: argparse.Namespace):
    """The :class:`rlft.data.prompts.Prompt` of ``--config`` with ``--prompt-template`` / ``--answer-format``
    applied; InputError naming the option when it cannot be used."""
    import dataclasses

    from rlft.data.prompts import Prompt, prompt_of

    prompt = Prompt()
    args.run_config = None
    if args.config:
        from rlft.config import ConfigError, load_config

        try:
            args.run_config = load_config(args.config)
            prompt = prompt_of(args.run_config)
        except (ConfigError, OSError) as exc:
            raise InputError(f"--config: {_one_line(exc)}") from None
    if args.prompt_template is not None:
        prompt = dataclasses.replace(prompt, template=args.prompt_template, messages=None)
    if args.answer_format is not None:
        prompt = dataclasses.replace(prompt, answer_format=args.answer_format)
    try:
        prompt.check()
    except ValueError as exc:
        option = "--answer-format" if "answer format" in str(exc) else "--prompt-template"
        raise InputError(f"{option}: {exc}") from None
    return prompt


def build_environment(args: argparse.Namespace):
    """``(environment, EnvironmentConfig)``: the environment whose episodes the answers are
    (``--environment``, else the config's ``environment.name`` when its ``evaluate_with_tools`` is
    true; the single-turn one with ``--no-tools``) and the config's section (its ``max_turns``,
    ``max_episode_tokens``, ``options``).  InputError naming the option when it cannot be used."""
    from rlft.config.schema import EnvironmentConfig
    from rlft.envs.guard import set_default_limits
    from rlft.envs.registry import DEFAULT_ENVIRONMENT, EnvironmentSpecError, make_environment

    if args.no_tools and args.environment:
        raise InputError("--environment and --no-tools: give one of them")
    e = args.run_config.environment if args.run_config is not None else EnvironmentConfig()
    name = args.environment or (e.name if e.evaluate_with_tools and not args.no_tools else DEFAULT_ENVIRONMENT)
    option = "--environment" if args.environment else "--config: environment.name"
    try:
        set_default_limits(e.step_timeout_s, e.max_reply_chars)  # the config's bounds on every call
        return make_environment(name, args.prompt, e.options if name == e.name else {},
                                tools=e.tools if name == e.name else ()), e
    except EnvironmentSpecError as exc:
        raise InputError(f"{option}: {exc}") from None


def build_spec(args: argparse.Namespace):
    """The engine's ``SamplingSpec``: the config's evaluation defaults with the options applied (stop
    strings: the answer format's)."""
    from rlft.config import SamplingConfig
    from rlft.engines.base import sampling_spec
    fmt = get_answer_format(args.prompt.answer_format if hasattr(args, "prompt") else DEFAULT_ANSWER_FORMAT)
    run = getattr(args, "run_config", None)
    # A run's config also gives its repetition penalty and forced minimum (what its evaluations use).
    base = {} if run is None else {"repetition_penalty": run.sampling.repetition_penalty,
                                   "min_tokens": run.sampling.min_tokens}
    cfg = SamplingConfig(top_p=args.top_p, eval_temperature=args.temperature, eval_max_tokens=args.max_tokens,
                         stop=list(fmt.stop), **base)
    # A forced minimum longer than the budget is impossible; cap it.
    cfg.min_tokens = min(cfg.min_tokens, args.max_tokens)
    return sampling_spec(cfg, n=args.k, seed=args.seed, evaluation=True)


def format_summary(summary: dict) -> str:
    """A short two-column table of the headline numbers."""
    k = summary.get("k", 1)
    rows = [
        ("examples", f"{summary['num_examples']}"),
        ("samples / question", f"{summary['num_samples']}"),
        ("accuracy (pass@1)", f"{summary['accuracy']:.4f}"),
        (f"pass@{k}", f"{summary['pass@k']:.4f}"),
        *([("lenient accuracy", f"{summary['accuracy_lenient']:.4f}"),  # any last answer or number
           (f"lenient pass@{k}", f"{summary['pass@k_lenient']:.4f}")] if "accuracy_lenient" in summary else []),
        ("format rate", f"{summary['format_rate']:.4f}"),
        ("mean reward", f"{summary['mean_reward']:.4f}"),
        ("mean response tokens", f"{summary['mean_response_length']:.1f}"),
    ]
    if "tool_call_rate" in summary:
        rows.append(("episodes with a tool call", f"{summary['tool_call_rate']:.4f}"))
        rows.append(("tool calls / episode", f"{summary['tool_calls_per_episode']:.2f}"))
        for key, name in (("accuracy_with_tool", "accuracy with a tool call"),
                          ("accuracy_without_tool", "accuracy without"), ("well_formed_rate", "well-formed calls"),
                          ("tool_error_rate", "tool errors / call"), ("void_turn_rate", "episodes with a void turn")):
            rows.append((name, "-" if summary.get(key) is None else f"{summary[key]:.4f}"))
    if "seconds" in summary:
        rows.append(("seconds", f"{summary['seconds']:.1f}"))
        rows.append(("examples / s", f"{summary['examples_per_s']:.2f}"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def load_inputs(args: argparse.Namespace) -> tuple[str, list[tuple[DataSpec, list]]]:
    """Check the options, resolve the model and load the examples, before anything heavy starts.

    Returns ``(model_path, [(data_spec, examples), ...])`` (one entry per ``--data``). Raises
    :class:`InputError` on bad input.
    """
    from rlft.data import load_examples
    from rlft.models.loading import ModelPathError, resolve_model_path

    check_args(args)
    specs = [parse_data_arg(text) for text in args.data or ["gsm8k:test"]]
    labels = [d.label for d in specs]
    check_out_dir(args.out, labels if len(labels) > 1 else [])  # before the evaluation, not after it
    if len(set(labels)) != len(labels):
        raise InputError(f"--data: two sets share an output name ({', '.join(labels)})")
    try:
        model_path = resolve_model_path(args.model)
    except ModelPathError as exc:
        raise InputError(_one_line(exc)) from None
    from rlft.data.rows import RowMapping

    # A run's config also says how its data's rows map to question and gold (data.fields, data.adapter);
    # --fields overrides its fields.
    rows = RowMapping.of(args.run_config.data) if getattr(args, "run_config", None) is not None else RowMapping()
    if args.fields:
        rows = parse_fields(args.fields, rows)
    sets = []
    for text, data in zip(args.data or ["gsm8k:test"], specs):
        try:
            loaded = load_examples(data.source, data.split, size=args.num_examples or None, seed=args.seed, rows=rows)
        except (FileNotFoundError, RuntimeError, ValueError) as exc:  # missing, offline hub, empty
            raise InputError(f"data {text!r}: {_one_line(exc)}") from None
        sets.append((data, loaded.examples))
    return model_path, sets


def prepare_engines() -> None:
    """Settings the engines read when they start (their records' `prepare_process`: vLLM's engine
    process is spawned, and its log goes to stderr, warnings only, so stdout holds the results),
    unless the user chose otherwise."""
    from rlft.engines import BACKENDS

    for record in BACKENDS.values():
        record.prepare_process()


def drop_long_questions(sets: list[tuple[DataSpec, list]], tokenizer, model_path: str, template,
                        max_tokens: int, rollout_environment=None) -> tuple[list[tuple[DataSpec, list]], dict[str, int]]:
    """Each set without the questions whose first-turn prompt (the opening of `rollout_environment`'s
    environment, as its episodes open) leaves no room for `max_tokens` (a multi-turn episode's
    `max_episode_tokens`) in the model's positions (one warning per set says how many), and how many
    each lost.  Raises InputError when no prompt can fit, or a set loses every question."""
    from rlft.data import LoadResult
    from rlft.data.prompts import SKIP_PROMPT_TOO_LONG, drop_long_prompts, prompt_token_limit
    from rlft.envs.rollouts import episode_budget, opening_lengths
    from rlft.models.loading import context_length

    env, e = rollout_environment or (None, None)
    whole_episode = env is not None and env.multi_turn and e.max_episode_tokens is not None
    budget = episode_budget(True, max_tokens, e.max_episode_tokens) if whole_episode else max_tokens
    try:
        limit = prompt_token_limit(context_length(model_path), budget,
                                   "environment.max_episode_tokens" if whole_episode else "--max-tokens")
    except ValueError as exc:
        raise InputError(_one_line(exc)) from None
    kept, skipped = [], {}
    for data, examples in sets:
        lengths = opening_lengths(env, examples, tokenizer) if env is not None and limit is not None else None
        result = drop_long_prompts(LoadResult(list(examples)), tokenizer, template, limit, f"{data.source}:{data.split}",
                                   lengths=lengths)
        skipped[data.label] = result.skipped.get(SKIP_PROMPT_TOO_LONG, 0)
        if not result.examples:
            raise InputError(f"data {data.source}:{data.split}: no question's prompt fits the model's positions "
                             f"with --max-tokens {max_tokens} (at most {limit} prompt tokens)")
        kept.append((data, result.examples))
    return kept, skipped


def evaluate_set(args: argparse.Namespace, engine, tokenizer, examples: list, spec) -> tuple[list[dict], dict]:
    """One set's records and summary (:func:`rlft.evaluate.scoring.evaluate`), as episodes of the
    environment (a multi-turn one's name and caps then in the summary)."""
    from rlft.envs.rollouts import episode_budget
    from rlft.evaluate.scoring import evaluate

    env, e = args.rollout_environment
    budget = episode_budget(env.multi_turn, spec.max_tokens, e.max_episode_tokens)
    records, summary = evaluate(engine, tokenizer, examples, spec=spec, k=args.k, batch_size=args.batch_size,
                                prompt_template=args.prompt, progress=not args.no_progress, environment=env,
                                max_turns=e.max_turns, max_episode_tokens=budget)
    if env.multi_turn:
        summary.update(environment=args.environment or e.name, max_turns=e.max_turns, max_episode_tokens=budget)
    return records, summary


def main(argv: list[str] | None = None) -> int:
    prepare_engines()  # before anything looks at CUDA or imports an engine
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        model_path, sets = load_inputs(args)
    except InputError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT

    import torch

    from rlft.engines import EngineUnavailable, resolve_backend
    from rlft.evaluate.scoring import write_results
    from rlft.models.loading import load_tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = build_spec(args)
    try:
        tokenizer = load_tokenizer(model_path, padding_side="left")
        try:
            args.prompt.check_tokenizer(tokenizer, args.model)
        except ValueError as exc:
            raise InputError(f"--prompt-template: {_one_line(exc)}") from None
        sets, skipped = drop_long_questions(sets, tokenizer, model_path, args.prompt, spec.max_tokens, args.rollout_environment)
    except OSError as exc:  # e.g. a hub id while offline, or a directory without a tokenizer
        print(f"{PROG}: error: could not load {args.model!r}: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except InputError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        backend = resolve_backend(args.backend, model_path, device)  # auto: the first usable here, as a run's
        engine = backend.build(model_path, dtype=resolve_dtype(args.dtype, device), device=device, seed=args.seed,
                               tokenizer=tokenizer,
                               options=backend.evaluation_options(device, gpu_share=args.gpu_memory_utilization))
    except OSError as exc:  # e.g. a hub id while offline, or a directory without a tokenizer
        print(f"{PROG}: error: could not load {args.model!r}: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except EngineUnavailable as exc:  # an engine named that cannot run here (vLLM missing, or for another device)
        print(f"{PROG}: error: --backend {args.backend}: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    with engine:  # closes the engine (vLLM's worker processes) however evaluation ends
        for data, examples in sets:
            out_dir = ((Path(args.out) / data.label if len(sets) > 1 else Path(args.out)) if args.out
                       else default_out_dir(args.model, data.label))
            print(f"{PROG}: {args.model} on {data.source}:{data.split} ({len(examples)} questions, k={args.k}, "
                  f"temperature={spec.temperature}, max_tokens={spec.max_tokens}, device={device})",
                  file=sys.stderr)
            records, summary = evaluate_set(args, engine, tokenizer, examples, spec)
            # What produced these numbers, so a summary file stands on its own.
            summary.update(model=args.model, data=f"{data.source}:{data.split}", split=data.split,
                           engine=type(engine).__name__, backend=backend.name, device=device,
                           temperature=spec.temperature, top_p=spec.top_p, max_tokens=spec.max_tokens, seed=args.seed,
                           prompt_template=args.prompt.template, answer_format=args.prompt.answer_format,
                           skipped_prompt_too_long=skipped[data.label])
            results_path, summary_path = write_results(out_dir, records, summary)
            print(f"\n{args.model} on {data.source}:{data.split}\n{format_summary(summary)}\nresults: {results_path}\n"
                  f"summary: {summary_path}")
    return 0
