"""The roles a rank can host, one small object each (built by `rlft.runtime.build.build_roles`):

    policy.py      PolicyTrainer: the trainable model as a DeepSpeed pipeline; optimises an injected
                   objective (rlft.objectives)
    rollout.py     RolloutWorker, the sampler: prompts -> grouped responses -> rewards -> advantages
                   -> the step's RolloutBatch
    reference.py   ReferenceModel: the frozen starting policy's log-probs of a batch
    evaluator.py   Evaluator: scores the eval split with a resident engine (and the evaluation
                   library python -m rlft.evaluate uses)
    sft_data.py    SFTFeeder: SFT's data role, tokenised (prompt, target) batches

Roles know nothing of ranks or the bridge: the trainers' steps move their results between ranks.
"""
