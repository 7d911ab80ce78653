"""Evaluation in one place:

    scoring.py   the library: prompts -> greedy answers from an engine -> grades, accuracy, records
    episodes.py  the same with a multi-turn environment: its episodes, the last turn graded, and the
                 tool figures (tool call rate, accuracy with and without a tool call)
    cli.py       python -m rlft.evaluate: score any model on a test split (the same scoring as training)
    inputs.py    what the command line names: --data sources, --fields, the default output directory
    __main__.py  the command's entry point

The training ranks' evaluation hook (rlft.runtime.run_eval) and the evaluator role
(rlft.roles.evaluator) call scoring.py.
"""
