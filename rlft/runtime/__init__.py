"""The per-rank runtime both trainers (rlft.train_grpo, rlft.train_sft) run on:

    context.py       RankContext (what a rank holds), device choice, the rank's dtype
    rank.py          command line, rank start (roles, device, bridge), failure and exit
    launcher_env.py  the launcher's environment (slurm, MPI, pdsh) -> rank, world, local rank
    entry.py         the starting model, the resolved config, the "already trained" entry rule
    build.py         build_roles: the rank's role objects from the topology
    bridge.py        process groups joining every rank, and the policy ranks' own world
    sync.py          fresh policy weights into the engines
    run_eval.py      the evaluation hook of the steps, and evaluating a finished model
    checkpoint.py    checkpoint layout, save and resume
    best_model.py    output.keep_best: the best evaluated step's weights in OUT/best_model
    reporting.py     steps.jsonl, log lines; merging every rank's metrics
    trackers.py      reporting.trackers: TensorBoard, Weights & Biases (offline), MLflow (a local store)
    loop.py          the step loop: reports, checkpoints
    memory_plan.py   the policy and an engine sharing one GPU: the start-up plan and its hints
    watchdog.py      a rank that stops answering: collective timeouts, peers that vanished
    profiling.py     torch profiler traces of chosen steps
"""
