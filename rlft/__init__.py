"""rlft: reinforcement-learning fine-tuning of LLMs (GRPO family) on verifiable maths.

    train_grpo.py   python -m rlft.train_grpo: every rank's GRPO step, top to bottom
    train_sft.py    python -m rlft.train_sft: the SFT step on the same runtime
    objectives.py   what the policy optimises: GRPOObjective and SFTObjective around the grpo maths
    curves.py       python -m rlft.curves: a run's reward curve and summary line
    common.py       small helpers every package uses (dtypes, log lines, ports, "module:attribute" settings)
    alarm.py        a deadline on the user's code in the main thread (a data adapter's rows, a plugin's import)
    config/         the run's configuration: schema, loading, checks, topology, launch plan
    data/           the run's data: examples (files, hub, generated), rows -> problems, prompts, prompt order
    grpo/           GRPO-family maths as pure torch functions, behind registries of records
    reward/         answers, formats, the grader and its worker pool, reward functions
    batching/       rollouts -> the padded training batch, micro-batches, dynamic sampling, overlong
    engines/        rollout engines (vLLM, HF generate) behind one interface and their records
    envs/           environments: single- and multi-turn episodes, tools (the calculator), their driver
    roles/          one object per role: policy, rollout, reference, evaluator, SFT data
    pipeline/       the policy as a DeepSpeed pipeline: stages, log-probs, weights, LoRA
    runtime/        what a rank runs on: start-up, bridge, sync, checkpoints, the step loop
    evaluate/       scoring a model on a test split (library and command)
    models/         model paths, GGUF conversion, tokenizers
    bench/          python -m rlft.bench: fixed-length GRPO workloads measured, JSON written
"""

__version__ = "0.1.0"
