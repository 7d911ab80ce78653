"""Evaluation in one place:

    scoring.py   the library: prompts -> greedy answers from an engine -> grades, accuracy, records
    cli.py       python -m rlft.evaluate: score any model on a test split (the same scoring as training)
    __main__.py  the command's entry point

The training ranks' evaluation hook (rlft.runtime.run_eval) and the evaluator role
(rlft.roles.evaluator) call scoring.py.
"""
