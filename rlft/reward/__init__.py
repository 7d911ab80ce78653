"""Rewards: reading answers out of responses, grading them, and the reward functions of a rollout.

* :mod:`rlft.reward.answers`   answer extraction and exact number forms (no eval of model text)
* :mod:`rlft.reward.grader`    the reward contract and :class:`~rlft.reward.grader.Grader`
* :mod:`rlft.reward.pool`      the grader's killable worker processes and their deadlines
* :mod:`rlft.reward.worker`    the worker process itself (symbolic checks, custom reward functions)
* :mod:`rlft.reward.functions` the reward of a rollout: built-in or named in the config
"""
