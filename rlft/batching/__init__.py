"""Shaping rollouts into what the policy trains on:

    batch.py             RolloutBatch: prompt + response ids padded, the response mask, Labels
    micro_batches.py     cutting a batch into micro-batches by token budget
    dynamic_sampling.py  keeping groups whose rewards differ (rounds of sampling until the batch is full)
    round_size.py        how many prompts each of those rounds draws (grpo.oversample; torch-free)
    overlong.py          responses cut by max_tokens: filtered out or softly penalised
"""
