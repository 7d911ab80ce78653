"""The roles a rank can host, one small object each (built by `rlft.runtime.build.build_roles` as
their records in `rlft.config.role_records` say):

    policy.py      PolicyTrainer: the trainable model as a DeepSpeed pipeline; optimises an injected
                   objective (rlft.objectives)
    rollout.py     RolloutWorker, the sampler: prompts -> grouped responses -> rewards -> advantages
                   -> the step's RolloutBatch; built from three parts, one job each:
      prompt_source.py   PromptSource: the training prompts and the order they are drawn in
      generation.py      RolloutGenerator: responses from the engine, and their rewards
      batch_queue.py     BatchQueue: batches collected ahead (asynchronous rollouts), their age
    reference.py   ReferenceModel: the frozen starting policy's log-probs of a batch
    teacher.py     Teacher: a stronger frozen model's log-probs of the student's samples (distillation)
    evaluator.py   Evaluator: scores the eval split with a resident engine (the evaluation itself
                   is the library rlft.evaluate.scoring, which python -m rlft.evaluate uses too)
    sft_data.py    SFTFeeder: SFT's data role, tokenised (prompt, target) batches
    update_guard.py  the policy's guard against a non-finite update: skipped steps, their count

Roles know nothing of ranks or the bridge: the trainers' steps move their results between ranks.
"""
