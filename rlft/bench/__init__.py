"""Benchmarks: ``python -m rlft.bench`` runs N GRPO steps of a fixed-length workload and writes JSON.

    presets.py       model shapes (random-1.5b, random-0.5b, tiny) and workloads (w-small, w-big, tiny)
    metrics.py       the figures from a run's steps.jsonl (medians over the steps after the first) and
                     their formulas; the printed table; benchmarks/results/summary.json
    environment.py   commit, GPU, library versions; every GPU's used memory during a run
    trl_baseline.py  TRL's GRPOTrainer (vLLM colocate) on the same work, in its own process
    raw_engine.py    the raw vLLM engine on the same prompts: the rollout baseline
    cli.py           the command: build the model, launch rlft (and TRL), write the result
    processes.py     the launches' child processes: their environment, a log, a time limit
    __main__.py      python -m rlft.bench

Formulas (N parameters, L layers, d hidden size, s mean sequence length; medians over steps 2..N):

    rollout tokens/s = response tokens / sample seconds
    train tokens/s   = prompt+response tokens / train seconds
    train MFU        = 6 N x train tokens / (train seconds x peak FLOP/s)  (attention ignored;
                       train_mfu_with_attention adds 12 L d s per token)
    sync GB/s        = N x bytes per parameter / sync seconds

Peak FLOP/s by GPU name (H200: 790 TFLOP/s bf16, this project's figure) or ``--peak-tflops``.
"""
