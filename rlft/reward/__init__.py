"""Rewards: reading answers out of responses, grading them, and the reward functions of a rollout.

    answers.py    answer extraction and exact number forms (no eval of model text)
    formats.py    answer formats (r1_tags, boxed, gsm8k): where the answer is, what is well-formed
    grader.py     the reward contract and Grader
    pool.py       the grader's killable worker processes and their deadlines
    worker.py     the worker process itself (symbolic checks, custom reward functions)
    functions.py  the reward of a rollout: built-in or named in the config
    lenient.py    the lenient reading of a response (the last number or box anywhere), for evaluation
"""
